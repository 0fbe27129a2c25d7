//! The gateway's clients of the engines: EngineControl and KvTransfer over one channel cache, the
//! HasBlocks fan-out, and the decode engines' Generate streams.

use super::worker::WorkerId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvwire::prompt_hashes;
use kvwire_grpc::pb::control::WorkerStatus;
use kvwire_grpc::pb::engine::{DecodeHolds, GenerateEvents, GenerateRequest};
use kvwire_grpc::pb::kv::HasBlocksRequest;
use kvwire_grpc::{GrpcTransport, KvTransport, TransportConfig};
use tokio::task::JoinSet;
use tonic::Status;

use crate::net::clients::ControlClient;
use crate::net::tls::{Tls, TlsError};

/// Clients of every engine, sharing one gRPC channel per address.
#[derive(Debug)]
pub struct Upstream {
    transport: Arc<GrpcTransport>,
    has_blocks_timeout: Duration,
}

impl Upstream {
    /// Clients whose HasBlocks and Release calls are bounded by `has_blocks_timeout`, over
    /// mutual TLS when `tls` is given, keeping at most `max_channels` connections.
    ///
    /// # Errors
    /// When the TLS client configuration cannot be built.
    pub fn new(
        has_blocks_timeout: Duration,
        tls: Option<&Tls>,
        max_channels: usize,
    ) -> Result<Self, TlsError> {
        let mut tc = TransportConfig::for_envelope(4096);
        tc.call_timeout = has_blocks_timeout.max(Duration::from_millis(1));
        tc.max_channels = max_channels;
        // A WatchBlocks stream lives as long as its engine: pings find a peer that went silent
        // (spec/limits.md's keepalive defaults).
        tc.keepalive = Some((Duration::from_secs(10), Duration::from_secs(20)));
        Ok(Self {
            // Every engine must prove it is a worker: a gateway's or an admin's certificate
            // cannot pose as one.
            transport: Arc::new(
                GrpcTransport::new(tc).with_connector(
                    tls.map(|t| t.connect(crate::net::dial::WORKER, tc.connect_timeout))
                        .transpose()?,
                ),
            ),
            has_blocks_timeout: tc.call_timeout,
        })
    }

    /// The EngineControl client of the engine at `addr`.
    ///
    /// # Errors
    /// INVALID_ARGUMENT for a malformed address.
    pub fn control(&self, addr: &str) -> Result<ControlClient, Status> {
        Ok(ControlClient::from_channel(self.transport.channel(addr)?))
    }

    /// Asks every decode engine in `decoders` at once which of `prompt`'s full blocks it holds;
    /// returns, per worker id, its answer (handed on to the Prefill, so the prefill engine does
    /// not ask again). An engine that fails, answers a wrong count, or takes longer than the
    /// HasBlocks timeout is left out.
    pub async fn cached_prefixes(
        &self,
        prompt: &[u32],
        scope: u64,
        decoders: &[&WorkerStatus],
    ) -> HashMap<WorkerId, DecodeHolds> {
        let mut asks = JoinSet::new();
        for w in decoders {
            let kv_format = w.kv_format.max(kvwire_grpc::KV_FORMAT_V1);
            let b = w.block_tokens.max(1) as usize;
            let hashes = prompt_hashes(prompt, b);
            let req = HasBlocksRequest {
                // The tokens decide, in the tenant's scope; the hashes only index them.
                tokens: prompt[..hashes.len() * b].to_vec(),
                hashes,
                // The format the engine beats with (v1 from every engine of this project).
                kv_format,
                model: w.model.clone(),
                cache_scope: scope,
            };
            let n = req.hashes.len();
            let (transport, id, addr, lookup) = (
                Arc::clone(&self.transport),
                WorkerId::of(w),
                w.kv_address.clone(),
                w.grpc_address.clone(),
            );
            let limit = self.has_blocks_timeout;
            asks.spawn(async move {
                // On its control port, where imports do not hold the threads that answer.
                let ask = kvwire_grpc::has_blocks_at(&*transport, Some(&lookup), &addr, req);
                let present = tokio::time::timeout(limit, ask).await;
                (id, kv_format, n, present)
            });
        }
        let mut cached = HashMap::new();
        while let Some(done) = asks.join_next().await {
            if let Ok((id, kv_format, n, Ok(Ok(present)))) = done
                && present.len() == n
            {
                cached.insert(id, DecodeHolds { kv_format, present });
            }
        }
        cached
    }

    /// Releases a transferred handle the decode engine at `kv_addr` holds.
    pub async fn release(&self, kv_addr: &str, handle: &str) {
        // A handle that cannot be released ends with its lease.
        let _ = self.transport.release(kv_addr, handle).await;
    }

    /// Opens `req`'s Generate stream on the decode engine whose EngineControl is at
    /// `grpc_addr` (the current span's trace context travels with the call).
    ///
    /// # Errors
    /// The engine's refusal, or UNAVAILABLE when it cannot be reached.
    pub async fn generate(
        &self,
        grpc_addr: &str,
        req: GenerateRequest,
    ) -> Result<tonic::Streaming<GenerateEvents>, Status> {
        self.control(grpc_addr)?.generate(req).await
    }
}

/// A handle the decode engine has not claimed yet: released if the request ends first (a
/// client gone, a refused resume, a timeout that drops the request mid-way).
#[derive(Debug)]
pub struct Unclaimed {
    upstream: Arc<Upstream>,
    kv: String,
    handle: String,
    armed: bool,
}

impl Unclaimed {
    /// `handle` on the decode engine at `kv`.
    #[must_use]
    pub fn new(upstream: Arc<Upstream>, kv: &str, handle: &str) -> Self {
        Self {
            upstream,
            kv: kv.to_owned(),
            handle: handle.to_owned(),
            armed: true,
        }
    }

    /// The decode engine took the handle.
    pub fn claimed(mut self) {
        self.armed = false;
    }

    /// Releases it now.
    pub async fn release(mut self) {
        self.armed = false;
        self.upstream.release(&self.kv, &self.handle).await;
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (up, kv, handle) = (
            Arc::clone(&self.upstream),
            std::mem::take(&mut self.kv),
            std::mem::take(&mut self.handle),
        );
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { up.release(&kv, &handle).await });
        }
    }
}
