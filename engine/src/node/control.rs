//! `tl.engine.v1.EngineControl`: the service a gateway drives. Its routing table is in one place
//! ([`Routes`] below); Prefill goes to the [`PrefillService`] an engine with the prefill role
//! built, and is refused with FAILED_PRECONDITION where none was.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use kvwire_grpc::glue::{self, Handler, MessageLimits, ResponseFuture, Routes};
use kvwire_grpc::pb::engine::{
    CancelRequest, CancelResponse, DrainRequest, DrainResponse, GenerateRequest, InfoRequest,
    InfoResponse, PrefillRequest, SetRoleRequest, SetRoleResponse, WatchBlocksRequest, path,
};
use kvwire_grpc::{KV_FORMAT_V1, KvReceiver};
use tonic::Status;
use tonic::body::Body;

use super::blocks::BlockFeed;
use super::config::Role;
use super::generate::Generator;
use super::prefill::PrefillService;
use super::state::NodeState;
use crate::net::authz::{ANY, Table};
use crate::net::tls::PeerRole;

/// Who may call EngineControl (spec/identities.md): Info is open to every role.
pub const POLICY: Table = &[
    (path::PREFILL, &[PeerRole::Gateway, PeerRole::Admin]),
    (path::CANCEL, &[PeerRole::Gateway, PeerRole::Admin]),
    (path::DRAIN, &[PeerRole::Gateway, PeerRole::Admin]),
    (path::WATCH_BLOCKS, &[PeerRole::Gateway, PeerRole::Admin]),
    (path::SET_ROLE, &[PeerRole::Gateway, PeerRole::Admin]),
    (path::GENERATE, &[PeerRole::Gateway, PeerRole::Admin]),
    (path::INFO, ANY),
];

/// Info, Cancel and Drain carry a few words: a larger message is refused by the decoder
/// (OUT_OF_RANGE) before it is buffered. Prefill keeps tonic's 4 MiB (a prompt of token ids).
const SMALL: MessageLimits = MessageLimits {
    max_decode: 1 << 20,
    max_encode: 1 << 20,
};

/// The longest a Drain or SetRole call waits for work to end: a caller's deadline beyond it
/// (up to `i64::MAX` ms) is cut to it, so no call holds its stream for years.
const MAX_WAIT: Duration = Duration::from_secs(600);

/// A call's relative `deadline_ms` as a wait: not negative, at most [`MAX_WAIT`].
fn wait_of(deadline_ms: i64) -> Duration {
    Duration::from_millis(deadline_ms.max(0) as u64).min(MAX_WAIT)
}

/// The EngineControl service of one node.
#[derive(Debug)]
pub struct EngineControl {
    state: Arc<NodeState>,
    prefill: Option<Arc<PrefillService>>,
    receiver: Option<Arc<KvReceiver>>,
    feed: Option<Arc<BlockFeed>>,
    generator: Option<Arc<Generator>>,
}

impl Routes for EngineControl {
    const NAME: &'static str = path::SERVICE;
    const ROUTES: &'static [(&'static str, Handler<Self>)] = &[
        (path::PREFILL, Self::prefill),
        (path::INFO, Self::info),
        (path::CANCEL, Self::cancel),
        (path::DRAIN, Self::drain),
        (path::WATCH_BLOCKS, Self::watch_blocks),
        (path::SET_ROLE, Self::set_role),
        (path::GENERATE, Self::generate),
    ];
}

impl EngineControl {
    /// The service over a node's parts: its state, its prefill service (prefill roles) and its
    /// KV receiver (decode roles).
    #[must_use]
    pub fn new(
        state: Arc<NodeState>,
        prefill: Option<Arc<PrefillService>>,
        receiver: Option<Arc<KvReceiver>>,
    ) -> Self {
        Self {
            state,
            prefill,
            receiver,
            feed: None,
            generator: None,
        }
    }

    /// The same service answering Generate with `generator` (decode roles).
    #[must_use]
    pub fn with_generator(mut self, generator: Option<Arc<Generator>>) -> Self {
        self.generator = generator;
        self
    }

    fn generate(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let me = Arc::clone(self);
        // The request carries its prompt's token ids: tonic's 4 MiB, as Prefill.
        glue::serve_server_streaming(
            req,
            MessageLimits::default(),
            move |m: GenerateRequest| async move {
                let Some(g) = &me.generator else {
                    return Err(Status::failed_precondition(format!(
                        "worker {} has no decode role",
                        me.state.id()
                    )));
                };
                tracing::Span::current().record("tl.worker", me.state.id());
                // The decode, a child of the call's span, open until its stream ends.
                let span = tracing::info_span!(
                    "engine.decode",
                    otel.kind = "internal",
                    tl.worker = me.state.id(),
                    kv.handle_id = m.resume.as_ref().map_or("", |r| r.handle_id.as_str()),
                );
                let started = tracing::Instrument::instrument(g.start(m), span.clone()).await?;
                Ok(started.into_stream().map(move |e| {
                    let _decode = &span;
                    e
                }))
            },
        )
    }

    /// The same service streaming `feed` on WatchBlocks (decode roles).
    #[must_use]
    pub fn with_feed(mut self, feed: Option<Arc<BlockFeed>>) -> Self {
        self.feed = feed;
        self
    }

    fn watch_blocks(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let me = Arc::clone(self);
        glue::serve_server_streaming(req, SMALL, move |_: WatchBlocksRequest| async move {
            match &me.feed {
                Some(f) => f.subscribe(),
                None => Err(Status::failed_precondition(format!(
                    "worker {} has no decode role: no block index to watch",
                    me.state.id()
                ))),
            }
        })
    }

    fn prefill(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let me = Arc::clone(self);
        glue::serve_unary(
            req,
            MessageLimits::default(),
            move |m: PrefillRequest| async move {
                match &me.prefill {
                    Some(p) => {
                        me.state.serves_prefill()?;
                        p.prefill(m).await
                    }
                    None => Err(Status::failed_precondition(format!(
                        "worker {} has no prefill role",
                        me.state.id()
                    ))),
                }
            },
        )
    }

    fn info(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let me = Arc::clone(self);
        glue::serve_unary(req, SMALL, move |_: InfoRequest| async move {
            Ok::<_, Status>(me.info_now())
        })
    }

    fn cancel(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let me = Arc::clone(self);
        glue::serve_unary(req, SMALL, move |m: CancelRequest| async move {
            let cancelled = me.prefill.as_ref().is_some_and(|p| p.cancel(&m.request_id));
            Ok::<_, Status>(CancelResponse { cancelled })
        })
    }

    fn drain(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let me = Arc::clone(self);
        glue::serve_unary(req, SMALL, move |m: DrainRequest| async move {
            let wait = wait_of(m.deadline_ms);
            let remaining = me.state.drain(wait).await;
            Ok::<_, Status>(DrainResponse {
                remaining: i32::try_from(remaining).unwrap_or(i32::MAX),
            })
        })
    }

    fn set_role(self: &Arc<Self>, req: http::Request<Body>) -> ResponseFuture {
        let me = Arc::clone(self);
        glue::serve_unary(req, SMALL, move |m: SetRoleRequest| async move {
            let to: Role = m.role.parse().map_err(|e: crate::net::role::UnknownRole| {
                Status::invalid_argument(e.to_string())
            })?;
            let before = me
                .state
                .set_serving(to)
                .map_err(|e| Status::failed_precondition(e.to_string()))?;
            tracing::info!(
                worker = me.state.id(),
                from = before.name(),
                to = to.name(),
                "role changed"
            );
            let wait = wait_of(m.deadline_ms);
            let state = &me.state;
            let remaining = state
                .wait_for(wait, || state.remaining_of(before, state.serving()))
                .await;
            Ok::<_, Status>(SetRoleResponse {
                serving: me.state.serving().names(),
                remaining: i32::try_from(remaining).unwrap_or(i32::MAX),
            })
        })
    }

    /// Live figures.
    #[must_use]
    pub fn info_now(&self) -> InfoResponse {
        let runner = self.state.runner();
        let model = runner.model();
        let shape = model.shape();
        // Published at every release of the pool lock: Info never waits behind compute.
        let counts = runner.pool().counts();
        InfoResponse {
            worker_id: self.state.id().to_owned(),
            roles: self.state.role().names(),
            model: model.name().to_owned(),
            kv_format: KV_FORMAT_V1,
            block_tokens: shape.dims.block_tokens,
            n_layers: shape.dims.n_layers,
            n_kv_heads: shape.dims.n_kv_heads,
            head_dim: shape.dims.head_dim,
            free_blocks: counts.free as u32,
            total_blocks: counts.total as u32,
            queue_depth: self.state.queue_depth(),
            running: runner.running(),
            draining: self.state.is_draining(),
            pending_handles: self.receiver.as_ref().map_or(0, |r| r.pending() as u32),
            used_blocks: counts.used as u32,
            cached_blocks: counts.cached as u32,
            serving: self.state.serving().names(),
        }
    }
}
