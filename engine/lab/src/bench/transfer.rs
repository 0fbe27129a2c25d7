//! `tl bench transfer`: KV transfer throughput over loopback gRPC against raw TCP, interleaved, plus RSS growth and the dedup saving.

use std::process::ExitCode;
use std::time::Instant;

use kvwire_grpc::{H2Limits, KvTransferService};
use tl_engine::net::server::{Lifecycle, serve_grpc};
use tl_engine::net::tls::{PeerRole, Tls};
use tl_engine::node::store::PoolStore;
use tl_engine_core::pool::{KvPool, SharedKv};

use super::{BenchError, median, round3};
use crate::run::{block_on, print_json};

/// Arguments of `tl bench transfer`.
#[derive(clap::Args, Debug)]
pub struct TransferArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    json: bool,
    /// MiB pushed per run (realistic-shape blocks of 2 MiB).
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// gRPC / raw TCP pairs, interleaved.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// CRC-32C implementation on both sides: auto, crc32c or crc-fast.
    #[arg(long, default_value = "auto")]
    crc: kvwire::CrcImpl,
    /// After the runs above, switch span export on (to an in-process OTLP receiver) and run as
    /// many gRPC / raw TCP pairs again, each push in a `kv.transfer` span: `traced_over_off`.
    #[arg(long)]
    trace: bool,
    /// Threads of the receiver's import lane, as `engine.import_threads` (the engine's default
    /// is 2); 0 copies in place on the async workers, each chunk handed off with
    /// `block_in_place`.
    #[arg(long, default_value_t = 2)]
    import_threads: usize,
    /// The library under rustls on both ends: aws-lc (the engine's default) or ring.
    #[arg(long, default_value = "aws-lc")]
    tls_crypto: tl_engine::net::tls::TlsCrypto,
    /// Run one leg alone, `--runs` times, and print only its figures: what a profiler
    /// (`perf record -e cpu-clock`, callgrind) attaches to, so each leg's samples are its own.
    #[arg(long, value_enum)]
    only: Option<Leg>,
}

/// One leg of the bench, named as in its JSON (`grpc_gbps`, `raw_tls_gbps`, ...).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
#[value(rename_all = "snake_case")]
pub enum Leg {
    /// The gRPC push, plain.
    Grpc,
    /// The gRPC push over mutual TLS.
    GrpcTls,
    /// Raw TCP, the baseline.
    Tcp,
    /// Raw rustls over TCP.
    RawTls,
}

/// Peak and current resident set of this process, in bytes, from /proc (Linux).
fn rss() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = s.lines().find(|l| l.starts_with(name))?;
        line.split_whitespace()
            .nth(1)?
            .parse::<u64>()
            .ok()
            .map(|kb| kb * 1024)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// Resets the peak resident set to the current one (Linux: write 5 to clear_refs).
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The prefill side of the transfer bench: a pool of `n` full, registered blocks.
fn filled_pool(shape: kvwire::Shape, n: usize) -> (SharedKv, Vec<u32>, Vec<u64>, Vec<u32>) {
    let pool = SharedKv::new(KvPool::new(shape, n));
    let mut hashes = Vec::with_capacity(n);
    let mut prompt = Vec::new();
    let ids = {
        let mut p = pool.lock();
        let ids = p.allocate(n).unwrap_or_default();
        let mut parent = 0;
        for (i, &id) in ids.iter().enumerate() {
            if let Ok(mut bytes) = p.payload_mut(id) {
                for (j, b) in bytes.iter_mut().enumerate() {
                    *b = (i * 131 + j * 7) as u8;
                }
            }
            let _ = p.set_fill(id, shape.block_tokens());
            let tokens: Vec<u32> = (0..shape.block_tokens())
                .map(|t| (i as u32) * 1000 + t)
                .collect();
            let key = tl_engine_core::pool::BlockKey {
                scope: 0,
                hash: kvwire::block_hash(parent, &tokens),
                tokens: &tokens,
                parent: i.checked_sub(1).map(|p| ids[p]),
            };
            parent = key.hash;
            p.register(id, key);
            hashes.push(parent);
            prompt.extend_from_slice(&tokens);
        }
        ids
    };
    (pool, ids, hashes, prompt)
}

/// Marks blocks as a model step leaves them, just written: their envelopes' seals are stale, so
/// the push that follows computes each sender's CRC, as a prefill engine's push of new blocks
/// does (one byte of each is rewritten with itself, outside any timing).
fn written_anew(pool: &SharedKv, ids: &[u32]) {
    let mut p = pool.lock();
    for &id in ids {
        if let Ok(mut b) = p.payload_mut(id)
            && let Some(x) = b.first().copied()
        {
            b[0] = x;
        }
    }
}

/// Touches every byte of a pool's slabs so that RSS measured afterwards shows only buffers.
fn pretouch(pool: &SharedKv) {
    let mut p = pool.lock();
    let n = p.counts().total;
    if let Ok(ids) = p.allocate(n) {
        for &id in &ids {
            if let Ok(mut b) = p.payload_mut(id) {
                b.fill(1);
            }
        }
        for id in ids {
            let _ = p.release(id);
        }
    }
}

/// CPU time the whole process has used so far (every thread, user and kernel).
fn process_cpu() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// What a run cost the process: the cores it kept busy on average (CPU time over wall time;
/// below the machine's core count, the run waited on something other than a core, a hand-off
/// between the two ends or a wakeup, for part of its time), and the minor page faults it took.
struct Used {
    cores: f64,
    faults: u64,
}

/// Runs `f` and returns its result with what it cost the process.
async fn with_cost<T>(f: impl std::future::Future<Output = T>) -> (T, Used) {
    let (cpu, wall, faults) = (process_cpu(), Instant::now(), minor_faults());
    let out = f.await;
    let cores = (process_cpu() - cpu) / wall.elapsed().as_secs_f64().max(1e-9);
    let faults = match (faults, minor_faults()) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => 0,
    };
    (out, Used { cores, faults })
}

/// Minor page faults the process has taken so far (`minflt` in /proc/self/stat, Linux): each
/// is a page touched for the first time since the allocator got it from the kernel, which the
/// kernel zeroes first. A transfer that reuses its buffers takes almost none per MiB.
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces: state
    // is the first, minflt the eighth.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(7)?.parse().ok()
}

/// One core's rates, the ceilings the TLS and copy figures stand against.
struct OneCore {
    /// AES-128-GCM sealing with the library rustls runs on (`--tls-crypto`), in 16 KiB records
    /// as TLS sends them. GCM opens at about the cost it seals (the same counter mode and GHASH
    /// passes).
    aes: f64,
    /// The same with each library: (aws-lc, ring).
    aes_by: (f64, f64),
    /// memcpy of a 2 MiB buffer into another, both reused.
    memcpy: f64,
    /// CRC-32C of a cached 2 MiB buffer, with the implementation the receiver uses.
    crc: f64,
    /// The same CRC of 2 MiB buffers that another thread has just written, as the receiving
    /// worker's socket copy leaves a payload for the import lane (and a model step leaves a block
    /// for its sender's seal): the rate a push's checks run at, and the one the gRPC ceilings
    /// use.
    crc_handed_over: f64,
    /// A cached 2 MiB block copied into memory that is not, as an import lands in the pool:
    /// with `copy_from_slice`, and with the pool's own copy (`copy::copy_to_pool`).
    to_cold: (f64, f64),
}

/// Copies a cached 2 MiB block over `cold` piece by piece, once with `copy_from_slice` and once
/// with the pool's copy, twice each in turn; the better rate of each, GB/s.
fn to_cold_rates(cold: &mut [u8]) -> (f64, f64) {
    let src = vec![9u8; 2 << 20];
    let (mut plain, mut stream) = (0f64, 0f64);
    for _ in 0..2 {
        for use_stream in [false, true] {
            let start = Instant::now();
            for piece in cold.chunks_exact_mut(src.len()) {
                if use_stream {
                    tl_engine_core::copy::copy_to_pool(piece, &src);
                } else {
                    piece.copy_from_slice(&src);
                }
            }
            std::hint::black_box(&mut *cold);
            let gbps = cold.len() as f64 / start.elapsed().as_secs_f64() / 1e9;
            let best = if use_stream { &mut stream } else { &mut plain };
            *best = best.max(gbps);
        }
    }
    (plain, stream)
}

/// CRC-32C of `rounds` 2 MiB buffers, each written just before by another thread: a writer
/// fills one buffer while this side checks the one before, two buffers passed back and forth, so
/// both threads are busy at once and run on two cores when there are two. Only the checks are
/// timed; GB/s.
fn crc_handed_over_rate(rounds: usize) -> f64 {
    use std::sync::mpsc::sync_channel;
    let (filled_tx, filled_rx) = sync_channel::<Vec<u8>>(1);
    let (empty_tx, empty_rx) = sync_channel::<Vec<u8>>(2);
    for _ in 0..2 {
        let _ = empty_tx.send(vec![0u8; 2 << 20]);
    }
    let writer = std::thread::spawn(move || {
        for i in 0..rounds {
            let Ok(mut buf) = empty_rx.recv() else { return };
            buf.fill(i as u8);
            if filled_tx.send(buf).is_err() {
                return;
            }
        }
    });
    let checker = std::thread::spawn(move || {
        let (mut spent, mut bytes) = (std::time::Duration::ZERO, 0usize);
        while let Ok(buf) = filled_rx.recv() {
            let start = Instant::now();
            std::hint::black_box(kvwire::crc32c(std::hint::black_box(&buf)));
            spent += start.elapsed();
            bytes += buf.len();
            // The writer may have finished and dropped its end: nothing more to hand back.
            let _ = empty_tx.send(buf);
        }
        bytes as f64 / spent.as_secs_f64().max(1e-9) / 1e9
    });
    let _ = writer.join();
    checker.join().unwrap_or(0.0)
}

/// GB/s of `seal` over 256 MiB of 16 KiB records, each with its own nonce (the record's number).
fn seal_rate(mut seal: impl FnMut(u64, &mut [u8]) -> bool) -> Result<f64, BenchError> {
    let mut record = vec![3u8; 16 << 10];
    let total = 256usize << 20;
    let start = Instant::now();
    for i in 0..total / record.len() {
        if !seal(i as u64, &mut record) {
            return Err("AES seal failed".into());
        }
        std::hint::black_box(&mut record);
    }
    Ok(total as f64 / start.elapsed().as_secs_f64() / 1e9)
}

/// AES-128-GCM sealing rate of one library (`ring` or `aws_lc_rs`, whose `aead` modules have
/// the same API), as rustls calls it.
macro_rules! aes_seal_rate {
    ($lib:ident) => {{
        use $lib::aead::{AES_128_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
        let key = LessSafeKey::new(
            UnboundKey::new(&AES_128_GCM, &[7u8; 16]).map_err(|_| "AES key refused")?,
        );
        seal_rate(|i, r| {
            let mut n = [0u8; 12];
            n[4..].copy_from_slice(&i.to_be_bytes());
            key.seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::empty(), r)
                .map(std::hint::black_box)
                .is_ok()
        })?
    }};
}

/// AES-128-GCM sealing rates, (aws-lc, ring).
fn aes_rates() -> Result<(f64, f64), BenchError> {
    Ok((aes_seal_rate!(aws_lc_rs), aes_seal_rate!(ring)))
}

fn one_core_rates() -> Result<OneCore, BenchError> {
    let aes_by = aes_rates()?;
    let aes = match tl_engine::net::tls::crypto() {
        tl_engine::net::tls::TlsCrypto::AwsLc => aes_by.0,
        tl_engine::net::tls::TlsCrypto::Ring => aes_by.1,
    };
    let total = 256usize << 20;
    let src = vec![5u8; 2 << 20];
    let mut dst = vec![0u8; 2 << 20];
    let start = Instant::now();
    for _ in 0..total / src.len() {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    let memcpy = total as f64 / start.elapsed().as_secs_f64() / 1e9;
    let start = Instant::now();
    for _ in 0..total / src.len() {
        std::hint::black_box(kvwire::crc32c(std::hint::black_box(&src)));
    }
    let crc = total as f64 / start.elapsed().as_secs_f64() / 1e9;
    let crc_handed_over = crc_handed_over_rate(total / src.len());
    // Twice the largest shared cache seen on these machines (260 MiB), touched first so that
    // the kernel's page clearing is not in the figure.
    let mut cold = vec![1u8; 512 << 20];
    let to_cold = to_cold_rates(&mut cold);
    Ok(OneCore {
        aes,
        aes_by,
        memcpy,
        crc,
        crc_handed_over,
        to_cold,
    })
}

/// The most each kind of stream could move over raw TCP's rate in a run, on `cores` cores: the
/// CPU that raw TCP spent per GB (both ends, kernel copies included) plus the work each kind
/// cannot skip, at one core's rates, with every core busy and nothing else spent. gRPC adds two
/// CRC-32C passes over blocks another thread wrote (`crc_handed_over`): the sender sealing each
/// block it pushes, once, and the receiver checking it; and the receiver's copy into the pool.
/// TLS adds sealing and opening (GCM opens at its sealing cost). Returns (gRPC, raw TLS, gRPC
/// over TLS).
fn ceilings_over_tcp(cores: f64, tcp_gbps: f64, tcp_cores: f64, one: &OneCore) -> [f64; 3] {
    let tcp = tcp_cores / tcp_gbps.max(1e-9);
    let grpc = 2.0 / one.crc_handed_over.max(1e-9) + 1.0 / one.to_cold.1.max(1e-9);
    let tls = 2.0 / one.aes.max(1e-9);
    [tcp + grpc, tcp + tls, tcp + grpc + tls].map(|per_gb| cores / per_gb / tcp_gbps.max(1e-9))
}

/// A byte stream of either kind.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// Mutual TLS settings of both ends of a raw stream.
type TlsPair = (
    std::sync::Arc<rustls::ServerConfig>,
    std::sync::Arc<rustls::ClientConfig>,
);

/// Sends `bytes_total` bytes in `chunk`-sized writes over one loopback connection (raw TCP, or
/// TLS over it) and waits for the receiver's one-byte ack; returns GB/s.
async fn stream_run(
    bytes_total: usize,
    chunk: &[u8],
    tls: Option<TlsPair>,
) -> std::io::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server_tls = tls
        .as_ref()
        .map(|(s, _)| tokio_rustls::TlsAcceptor::from(s.clone()));
    let server = tokio::spawn(async move {
        let (s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let mut s: Box<dyn Io> = match server_tls {
            Some(a) => Box::new(a.accept(s).await?),
            None => Box::new(s),
        };
        let mut buf = vec![0u8; 2 << 20];
        let mut got = 0;
        while got < bytes_total {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            got += n;
        }
        s.write_all(&[1]).await?;
        s.flush().await?;
        Ok::<usize, std::io::Error>(got)
    });
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    // The handshake is outside the measurement, as a long-lived connection's would be.
    let mut c: Box<dyn Io> = match tls {
        Some((_, client)) => {
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1")
                .map_err(std::io::Error::other)?
                .to_owned();
            Box::new(
                tokio_rustls::TlsConnector::from(client)
                    .connect(name, tcp)
                    .await?,
            )
        }
        None => Box::new(tcp),
    };
    let start = Instant::now();
    let mut sent = 0;
    while sent < bytes_total {
        let n = chunk.len().min(bytes_total - sent);
        c.write_all(&chunk[..n]).await?;
        sent += n;
    }
    c.flush().await?;
    let mut ack = [0u8; 1];
    c.read_exact(&mut ack).await?;
    let secs = start.elapsed().as_secs_f64();
    let got = server.await.map_err(std::io::Error::other)??;
    if got != bytes_total {
        return Err(std::io::Error::other("short read"));
    }
    Ok(bytes_total as f64 / secs / 1e9)
}

/// Runs `tl bench transfer`.
#[must_use]
pub fn transfer(args: &TransferArgs) -> ExitCode {
    kvwire::set_crc_impl(args.crc);
    tl_engine::net::tls::set_crypto(args.tls_crypto);
    block_on(async { print_json(transfer_bench(args).await) })
}

/// The source of the pushes: a pool of filled blocks, and the receiver that frees what each
/// push brought, so the next moves every block again.
struct Pusher<'a> {
    /// The source pool itself, to mark its blocks written before each push.
    pool: &'a SharedKv,
    src: std::sync::Arc<dyn kvwire_grpc::KvStore>,
    dst: std::sync::Arc<dyn kvwire_grpc::KvStore>,
    rx: std::sync::Arc<kvwire_grpc::KvReceiver>,
    ids: &'a [u32],
    hashes: &'a [u64],
    prompt: &'a [u32],
}

/// Runs `leg`, its cores and page faults recorded in column `k` of `out`; its result.
async fn costed<T>(
    out: &mut Runs,
    k: usize,
    bytes_mib: f64,
    leg: impl std::future::Future<Output = Result<T, BenchError>>,
) -> Result<T, BenchError> {
    let (r, c) = with_cost(leg).await;
    out.cores[k].push(c.cores);
    out.faults[k].push(c.faults as f64 / bytes_mib);
    r
}

/// Each run's figures, per leg.
#[derive(Default)]
struct Runs {
    grpc: Vec<f64>,
    tls: Vec<f64>,
    tcp: Vec<f64>,
    raw: Vec<f64>,
    ratios: Vec<f64>,
    tls_ratios: Vec<f64>,
    raw_ratios: Vec<f64>,
    tls_over_raw: Vec<f64>,
    /// Cores kept busy: gRPC, gRPC over TLS, raw TCP, raw TLS.
    cores: [Vec<f64>; 4],
    /// Minor page faults per MiB moved, in the same order.
    faults: [Vec<f64>; 4],
}

/// The four ways a push's bytes go: gRPC in plain text and over mutual TLS (a transport and
/// its target each), and the raw baselines' chunk and TLS configurations.
struct Legs<'a> {
    plain: (&'a kvwire_grpc::GrpcTransport, &'a str),
    tls: (&'a kvwire_grpc::GrpcTransport, &'a str),
    tcp_chunk: &'a [u8],
    raw_tls: TlsPair,
}

impl Pusher<'_> {
    /// One push of the first `count` blocks over `transport`; its stats and seconds.
    async fn push(
        &self,
        transport: &kvwire_grpc::GrpcTransport,
        target: &str,
        handle: &str,
        count: usize,
    ) -> Result<(kvwire_grpc::TransferStats, f64), BenchError> {
        written_anew(self.pool, &self.ids[..count]);
        let start = Instant::now();
        let st = kvwire_grpc::transfer(
            transport,
            std::sync::Arc::clone(&self.src),
            kvwire_grpc::Push {
                target,
                handle_id: handle,
                model: "fake",
                hashes: &self.hashes[..count],
                n_blocks: self.ids[..count].len(),
                known: None,
                lookup: None,
                tokens: &self.prompt[..count * self.prompt.len() / self.ids.len().max(1)],
                scope: 0,
            },
            &self.ids[..count],
        )
        .await?;
        let secs = start.elapsed().as_secs_f64();
        if let Some(c) = self.rx.claim(handle) {
            self.dst.release_forget(&c.into_ids());
        }
        Ok((st, secs))
    }

    /// One push of every block over `(transport, target)` named `handle`: its GB/s and the
    /// bytes it moved.
    async fn gbps(
        &self,
        (transport, target): (&kvwire_grpc::GrpcTransport, &str),
        handle: &str,
    ) -> Result<(f64, usize), BenchError> {
        let (st, secs) = self.push(transport, target, handle, self.ids.len()).await?;
        Ok((
            st.payload_bytes as f64 / secs / 1e9,
            st.payload_bytes as usize,
        ))
    }

    /// `runs` runs, each pushing over gRPC, over gRPC with TLS, and the same bytes over raw
    /// TCP and raw TLS, one after the other.
    async fn paired(&self, legs: &Legs<'_>, runs: usize) -> Result<Runs, BenchError> {
        let n = self.ids.len();
        let p_bytes = self.pool.lock().shape().payload_bytes().unwrap_or(0);
        let bytes_mib = (n as f64) * p_bytes as f64 / f64::from(1u32 << 20);
        let mut out = Runs::default();
        for run in 0..runs {
            let (g, bytes) = costed(
                &mut out,
                0,
                bytes_mib,
                self.gbps(legs.plain, &format!("run-{run}")),
            )
            .await?;
            let (s, _) = costed(
                &mut out,
                1,
                bytes_mib,
                self.gbps(legs.tls, &format!("tls-{run}")),
            )
            .await?;
            let t = costed(&mut out, 2, bytes_mib, async {
                Ok(stream_run(bytes, legs.tcp_chunk, None).await?)
            })
            .await?;
            let r = costed(&mut out, 3, bytes_mib, async {
                Ok(stream_run(bytes, legs.tcp_chunk, Some(legs.raw_tls.clone())).await?)
            })
            .await?;
            out.grpc.push(g);
            out.tls.push(s);
            out.tcp.push(t);
            out.raw.push(r);
            out.ratios.push(g / t);
            out.tls_ratios.push(s / t);
            out.raw_ratios.push(r / t);
            out.tls_over_raw.push(s / r);
        }
        Ok(out)
    }

    /// One leg alone, `runs` times: its rate and cost per run, nothing else in the process's
    /// profile.
    async fn only(
        &self,
        legs: &Legs<'_>,
        leg: Leg,
        runs: usize,
    ) -> Result<serde_json::Value, BenchError> {
        let n = self.ids.len();
        let p_bytes = self.pool.lock().shape().payload_bytes().unwrap_or(0);
        let (mut rates, mut busy) = (Vec::new(), Vec::new());
        let bytes = n * p_bytes;
        for run in 0..runs {
            let (gbps, c) = with_cost(async {
                Ok::<f64, BenchError>(match leg {
                    Leg::Grpc | Leg::GrpcTls => {
                        let (t, at) = if leg == Leg::Grpc {
                            legs.plain
                        } else {
                            legs.tls
                        };
                        let (st, secs) = self.push(t, at, &format!("only-{run}"), n).await?;
                        st.payload_bytes as f64 / secs / 1e9
                    }
                    Leg::Tcp => stream_run(bytes, legs.tcp_chunk, None).await?,
                    Leg::RawTls => {
                        stream_run(bytes, legs.tcp_chunk, Some(legs.raw_tls.clone())).await?
                    }
                })
            })
            .await;
            rates.push(gbps?);
            busy.push(c.cores);
        }
        let leg_name = match leg {
            Leg::Grpc => "grpc",
            Leg::GrpcTls => "grpc_tls",
            Leg::Tcp => "tcp",
            Leg::RawTls => "raw_tls",
        };
        Ok(serde_json::json!({
            "bench": "transfer",
            "only": leg_name,
            "push_mib": round3(bytes as f64 / (1 << 20) as f64),
            "runs": rates.len(),
            "gbps": round3(median(&mut rates.clone())),
            "gbps_all": rates.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
            "cores_busy": round3(median(&mut busy.clone())),
            "core_seconds_per_gb": round3(median(&mut busy) / median(&mut rates)),
            "cpu": super::cpu_json(),
            "crc_impl": kvwire::crc32c_impl(),
        }))
    }

    /// Peak RSS growth during a push, for a quarter of the blocks and for all of them (pools
    /// are already resident, so growth is the transfer's own buffering).
    async fn rss_growth(
        &self,
        transport: &kvwire_grpc::GrpcTransport,
        target: &str,
        n: usize,
        p_bytes: usize,
    ) -> Result<serde_json::Map<String, serde_json::Value>, BenchError> {
        let mut rss_growth = serde_json::Map::new();
        for count in [n.div_ceil(4), n] {
            let before = rss().map(|r| r.1);
            let reset = reset_peak_rss();
            self.push(transport, target, &format!("rss-{count}"), count)
                .await?;
            let after = rss().map(|r| r.0);
            if let (true, Some(b), Some(a)) = (reset, before, after) {
                let key = format!("push_{}_mib", (count * p_bytes) >> 20);
                rss_growth.insert(
                    key,
                    serde_json::json!(round3(a.saturating_sub(b) as f64 / (1 << 20) as f64)),
                );
            }
        }
        Ok(rss_growth)
    }

    /// Dedup saving: the decode side already holds the first 75% of the prompt. The prefix's
    /// push, the whole prompt's, and the seconds of the latter.
    async fn dedup_75(
        &self,
        transport: &kvwire_grpc::GrpcTransport,
        target: &str,
    ) -> Result<(kvwire_grpc::TransferStats, kvwire_grpc::TransferStats, f64), BenchError> {
        use std::sync::Arc;
        let n = self.ids.len();
        let cached = n * 3 / 4;
        // Push the prefix and release it normally, so its blocks stay cached on the decode side.
        let st_prefix = kvwire_grpc::transfer(
            transport,
            Arc::clone(&self.src),
            kvwire_grpc::Push {
                target,
                handle_id: "prefix",
                model: "fake",
                hashes: &self.hashes[..cached],
                n_blocks: self.ids[..cached].len(),
                known: None,
                lookup: None,
                tokens: &self.prompt[..cached * 16],
                scope: 0,
            },
            &self.ids[..cached],
        )
        .await?;
        self.rx.release("prefix");
        let start = Instant::now();
        let st75 = kvwire_grpc::transfer(
            transport,
            Arc::clone(&self.src),
            kvwire_grpc::Push {
                target,
                handle_id: "dedup",
                model: "fake",
                hashes: self.hashes,
                n_blocks: self.ids.len(),
                known: None,
                lookup: None,
                tokens: self.prompt,
                scope: 0,
            },
            self.ids,
        )
        .await?;
        let secs75 = start.elapsed().as_secs_f64();
        if let Some(c) = self.rx.claim("dedup") {
            self.dst.release(&c.into_ids());
        }
        Ok((st_prefix, st75, secs75))
    }

    /// With span export on: `runs` pairs, off then on (each push in a client span; the
    /// server's spans come from the service itself), each against its own raw TCP run.
    async fn traced(
        &self,
        transport: &kvwire_grpc::GrpcTransport,
        target: &str,
        runs: usize,
        tcp_chunk: &[u8],
    ) -> Result<serde_json::Value, BenchError> {
        let n = self.ids.len();
        let tracing = super::Tracing::start().await?;
        // Pairs, off then on (each push in a client span), each against its own raw TCP run.
        let (mut on_ratios, mut off_ratios) = (Vec::new(), Vec::new());
        for run in 0..runs {
            use tracing::Instrument;
            let (st, secs) = self
                .push(transport, target, &format!("untraced-{run}"), n)
                .await?;
            let t = stream_run(st.payload_bytes as usize, tcp_chunk, None).await?;
            off_ratios.push(st.payload_bytes as f64 / secs / 1e9 / t);
            let span = tracing::info_span!("kv.transfer", otel.kind = "client");
            let (st, secs) = tracing
                .traced(
                    self.push(transport, target, &format!("traced-{run}"), n)
                        .instrument(span),
                )
                .await?;
            let t = stream_run(st.payload_bytes as usize, tcp_chunk, None).await?;
            on_ratios.push(st.payload_bytes as f64 / secs / 1e9 / t);
        }
        let on = median(&mut on_ratios.clone());
        let off = median(&mut off_ratios.clone());
        Ok(serde_json::json!({
            "grpc_traced_over_tcp": round3(on),
            "grpc_untraced_over_tcp": round3(off),
            "traced_over_off": round3(on / off),
            "export": tracing.finish().await,
        }))
    }
}

/// The cipher suite a TLS client with `tls`'s settings negotiates with the server at `addr`.
async fn negotiated_suite(tls: &Tls, addr: &str) -> Result<String, BenchError> {
    let connector = tokio_rustls::TlsConnector::from(tls.client_config(&[b"h2"])?);
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?.to_owned();
    let conn = connector.connect(name, tcp).await?;
    Ok(conn
        .get_ref()
        .1
        .negotiated_cipher_suite()
        .map_or_else(|| "none".into(), |s| format!("{:?}", s.suite())))
}

async fn transfer_bench(args: &TransferArgs) -> Result<serde_json::Value, BenchError> {
    use std::sync::Arc;

    use kvwire_grpc::{GrpcTransport, KvReceiver, KvStore, TransportConfig};

    let shape = kvwire::Shape::v1(16, 32, 8, 128);
    let p_bytes = shape.payload_bytes().ok_or("the shape overflows")?;
    let n = (args.mib << 20).div_ceil(p_bytes).max(1);
    let (src_pool, ids, hashes, prompt) = filled_pool(shape, n);
    let dst_pool = SharedKv::new(KvPool::new(shape, n));
    pretouch(&dst_pool);
    let dst_store: Arc<dyn KvStore> = Arc::new(PoolStore::new(dst_pool.clone()));
    let src_store: Arc<dyn KvStore> = Arc::new(PoolStore::new(src_pool.clone()));
    let rx = Arc::new(KvReceiver::new(Arc::clone(&dst_store), "fake"));
    // The receiver as an engine serves it: chunks checked and copied on an import lane's
    // threads (`engine.import_threads`), or in place when 0.
    let lane = match args.import_threads {
        0 => None,
        n => Some(kvwire_grpc::ImportLane::new("kv-import", n)?),
    };
    let service = || {
        let svc = KvTransferService::new(Arc::clone(&rx));
        match &lane {
            Some(l) => svc.with_import_lane(l.clone()),
            None => svc,
        }
        .into_service()
    };
    // The plain port outlives the TLS one: the RSS and dedup runs below use it.
    let (plain, life) = (Lifecycle::new(), Lifecycle::new());
    let target = serve_grpc(
        &plain,
        tokio::net::TcpListener::bind("127.0.0.1:0").await?,
        service(),
        None,
        H2Limits::default(),
    )?
    .to_string();
    let transport = GrpcTransport::new(TransportConfig::for_envelope(
        shape.envelope_len(1).ok_or("overflow")?,
    ));
    let tcp_chunk = vec![7u8; shape.envelope_len(1).ok_or("overflow")?];

    // The same receiver behind a second port with mutual TLS, and a sender with its own
    // certificate: the push over TLS, against the same raw TCP baseline.
    let certs = std::env::temp_dir().join(format!(
        "tl-bench-certs-{}-{}",
        std::process::id(),
        tl_engine::net::tls::random_hex::<4>()
    ));
    let issue = |id: &str, role| -> Result<Tls, BenchError> {
        Ok(Tls::load(
            &tl_engine::net::tls::issue(&certs, id, role, &[])?.section(),
        )?)
    };
    let (d_tls, p_tls) = (
        issue("D", PeerRole::Decode)?,
        issue("P", PeerRole::Prefill)?,
    );
    let _ = std::fs::remove_dir_all(&certs);
    let tls_target = serve_grpc(
        &life,
        tokio::net::TcpListener::bind("127.0.0.1:0").await?,
        service(),
        Some(d_tls.server_config(&[b"h2"])?),
        H2Limits::default(),
    )?
    .to_string();
    // The channel a prefill engine pushes over: our connector, which checks the target's
    // role, with the process's own rustls configuration.
    let tc = TransportConfig::for_envelope(shape.envelope_len(1).ok_or("overflow")?);
    let tls_transport = GrpcTransport::new(tc).with_connector(Some(
        p_tls.connect(tl_engine::net::dial::DECODE_TARGET, tc.connect_timeout)?,
    ));
    let suite = negotiated_suite(&p_tls, &tls_target).await?;

    let bench = Pusher {
        pool: &src_pool,
        src: Arc::clone(&src_store),
        dst: Arc::clone(&dst_store),
        rx: Arc::clone(&rx),
        ids: &ids,
        hashes: &hashes,
        prompt: &prompt,
    };
    // Warm-up: connections, allocator.
    bench.push(&transport, &target, "warm", n.min(4)).await?;
    bench
        .push(&tls_transport, &tls_target, "warm-tls", n.min(4))
        .await?;
    let raw_tls = (
        d_tls.server_config(&[b"h2"])?,
        p_tls.client_config(&[b"h2"])?,
    );
    let legs = Legs {
        plain: (&transport, &target),
        tls: (&tls_transport, &tls_target),
        tcp_chunk: &tcp_chunk,
        raw_tls: raw_tls.clone(),
    };
    if let Some(leg) = args.only {
        let v = bench.only(&legs, leg, args.runs.max(1)).await;
        life.shutdown().await;
        plain.shutdown().await;
        return v;
    }
    let runs = bench.paired(&legs, args.runs.max(1)).await?;
    let traced = if args.trace {
        Some(
            bench
                .traced(&transport, &target, args.runs.max(1), &tcp_chunk)
                .await?,
        )
    } else {
        None
    };
    life.shutdown().await;
    let one = one_core_rates()?;
    let rss_growth = bench.rss_growth(&transport, &target, n, p_bytes).await?;
    let dedup = bench.dedup_75(&transport, &target).await?;
    plain.shutdown().await;
    Ok(report(&Measured {
        blocks: n,
        block_bytes: p_bytes,
        envelope_bytes: shape.envelope_len(1).unwrap_or(0),
        import_threads: args.import_threads,
        runs,
        traced,
        suite,
        one,
        rss_growth,
        dedup,
    }))
}

/// What one `tl bench transfer` run measured, before it is reported.
struct Measured {
    blocks: usize,
    block_bytes: usize,
    envelope_bytes: usize,
    import_threads: usize,
    runs: Runs,
    traced: Option<serde_json::Value>,
    suite: String,
    one: OneCore,
    rss_growth: serde_json::Map<String, serde_json::Value>,
    /// The 75%-cached push: the prefix's stats, the push's, and its seconds.
    dedup: (kvwire_grpc::TransferStats, kvwire_grpc::TransferStats, f64),
}

/// The run's JSON report: medians, every run's figure, and the ceilings over raw TCP computed
/// from the same run's measurements.
fn report(m: &Measured) -> serde_json::Value {
    let Runs {
        grpc,
        tls,
        tcp,
        raw,
        ratios,
        tls_ratios,
        raw_ratios,
        tls_over_raw,
        cores,
        faults,
    } = &m.runs;
    let (n, p_bytes, one) = (m.blocks, m.block_bytes, &m.one);
    let (st_prefix, st75, secs75) = &m.dedup;
    let n_cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get) as f64;
    let ceilings: Vec<[f64; 3]> = tcp
        .iter()
        .zip(&cores[2])
        .map(|(&t, &c)| ceilings_over_tcp(n_cores, t, c, one))
        .collect();
    let ceiling = |k: usize| {
        round3(median(
            &mut ceilings.iter().map(|c| c[k]).collect::<Vec<_>>(),
        ))
    };
    let [c_grpc, c_tls, c_tcp, c_raw_tls] = cores.clone().map(|mut v| round3(median(&mut v)));
    let [f_grpc, f_tls, f_tcp, f_raw_tls] = faults.clone().map(|mut v| round3(median(&mut v)));
    let full_bytes = n as u64 * m.envelope_bytes as u64;
    serde_json::json!({
        "tracing": m.traced,
        "bench": "transfer",
        "shape": "B=16 L=32 H=8 D=128 (2 MiB blocks)",
        "blocks_per_push": n,
        "sender_seals_each_push": true,
        "import_threads": m.import_threads,
        "push_mib": round3((n * p_bytes) as f64 / (1 << 20) as f64),
        "runs": grpc.len(),
        "grpc_gbps": round3(median(&mut grpc.clone())),
        "tcp_gbps": round3(median(&mut tcp.clone())),
        "grpc_over_tcp": round3(median(&mut ratios.clone())),
        "grpc_gbps_all": grpc.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
        "grpc_tls_gbps": round3(median(&mut tls.clone())),
        "grpc_tls_over_tcp": round3(median(&mut tls_ratios.clone())),
        "grpc_tls_gbps_all": tls.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
        "tls": { "version": "TLS 1.3, mutual", "cipher_suite": m.suite, "provider": format!("rustls + {}", tl_engine::net::tls::crypto()) },
        "raw_tls_gbps": round3(median(&mut raw.clone())),
        "raw_tls_over_tcp": round3(median(&mut raw_ratios.clone())),
        "grpc_tls_over_raw_tls": round3(median(&mut tls_over_raw.clone())),
        "cpu": super::cpu_json(),
        "kernel": super::kernel_json(),
        "tcp_gbps_all": tcp.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
        "peak_rss_growth_mib": m.rss_growth,
        "dedup_75pct_cached": {
            "prefix_blocks_sent_first": st_prefix.sent,
            "blocks_sent": st75.sent,
            "blocks_deduped": st75.deduped,
            "payload_bytes": st75.payload_bytes,
            "full_payload_bytes": full_bytes,
            "bytes_saved_fraction": round3(1.0 - st75.payload_bytes as f64 / full_bytes as f64),
            "seconds": round3(*secs75),
        },
        "crc_impl": kvwire::crc32c_impl(),
        "cores_busy": {
            "note": "process CPU time over wall time during each run (medians); 2 = both cores always busy",
            "grpc": c_grpc,
            "grpc_tls": c_tls,
            "tcp": c_tcp,
            "raw_tls": c_raw_tls,
        },
        "minor_faults_per_mib": {
            "note": "pages the process touched for the first time during each run, per MiB moved (medians); 256 = every received byte landed in a fresh page",
            "grpc": f_grpc,
            "grpc_tls": f_tls,
            "tcp": f_tcp,
            "raw_tls": f_raw_tls,
        },
        "ceiling_over_tcp": {
            "note": "the most each could reach over raw TCP in the same run: raw TCP's CPU per GB (both ends) plus the work each cannot skip (gRPC: the sender's and the receiver's CRC-32C of a block another thread wrote, and the receiver's pool copy; TLS: seal and open) at one_core's rates, every core busy, nothing else spent (medians over runs)",
            "grpc": ceiling(0),
            "raw_tls": ceiling(1),
            "grpc_tls": ceiling(2),
        },
        "one_core": {
            "aes_128_gcm_seal_gbps": round3(one.aes),
            "aes_128_gcm_seal_gbps_aws_lc": round3(one.aes_by.0),
            "aes_128_gcm_seal_gbps_ring": round3(one.aes_by.1),
            "crc32c_2mib_gbps": round3(one.crc),
            "crc32c_2mib_handed_over_gbps": round3(one.crc_handed_over),
            "memcpy_2mib_gbps": round3(one.memcpy),
            "copy_2mib_to_cold_gbps": round3(one.to_cold.0),
            "pool_copy_2mib_to_cold_gbps": round3(one.to_cold.1),
            "pool_copy_over_copy": round3(one.to_cold.1 / one.to_cold.0.max(1e-9)),
        },
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_takes_the_legs_json_names() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: super::TransferArgs,
        }
        for (name, leg) in [
            ("grpc", super::Leg::Grpc),
            ("grpc_tls", super::Leg::GrpcTls),
            ("tcp", super::Leg::Tcp),
            ("raw_tls", super::Leg::RawTls),
        ] {
            let cli = Cli::try_parse_from(["tl", "--only", name]).unwrap();
            assert_eq!(cli.args.only, Some(leg), "{name}");
        }
        assert!(Cli::try_parse_from(["tl", "--only", "grpc-tls"]).is_err());
        assert_eq!(Cli::try_parse_from(["tl"]).unwrap().args.only, None);
    }

    #[test]
    fn ceilings_add_each_streams_own_work_to_raw_tcps() {
        let one = super::OneCore {
            aes: 4.0,
            aes_by: (4.0, 2.0),
            memcpy: 30.0,
            crc: 64.0,
            crc_handed_over: 16.0,
            to_cold: (12.0, 16.0),
        };
        // Raw TCP: 4 GB/s with 1.6 cores busy, 0.4 core-seconds per GB. gRPC adds two CRCs at
        // 1/16 and a copy at 1/16, TLS 2/4: two cores then move at most 2/0.5875, 2/0.9 and
        // 2/1.0875 GB/s.
        let [grpc, tls, grpc_tls] = super::ceilings_over_tcp(2.0, 4.0, 1.6, &one);
        assert!((grpc - 2.0 / 0.5875 / 4.0).abs() < 1e-9, "{grpc}");
        assert!((tls - 2.0 / 0.9 / 4.0).abs() < 1e-9, "{tls}");
        assert!((grpc_tls - 2.0 / 1.0875 / 4.0).abs() < 1e-9, "{grpc_tls}");
        // One core fewer halves every ceiling; a faster cipher raises only the TLS ones.
        let [g1, ..] = super::ceilings_over_tcp(1.0, 4.0, 1.6, &one);
        assert!((g1 - grpc / 2.0).abs() < 1e-9);
        let fast = super::OneCore { aes: 40.0, ..one };
        let [g2, t2, gt2] = super::ceilings_over_tcp(2.0, 4.0, 1.6, &fast);
        assert!((g2 - grpc).abs() < 1e-9 && t2 > tls && gt2 > grpc_tls);
        // The receiver's check is a handed-over payload's: the cached rate moves nothing, a
        // slower handed-over rate lowers only the gRPC ceilings.
        let hot = super::OneCore { crc: 1e6, ..one };
        assert_eq!(super::ceilings_over_tcp(2.0, 4.0, 1.6, &hot)[0], grpc);
        let cold = super::OneCore {
            crc_handed_over: 8.0,
            ..one
        };
        let [g3, t3, gt3] = super::ceilings_over_tcp(2.0, 4.0, 1.6, &cold);
        assert!(g3 < grpc && (t3 - tls).abs() < 1e-9 && gt3 < grpc_tls);
    }

    /// The handed-over CRC rate ends, with no round or a few, and is a rate.
    #[test]
    fn crc_handed_over_rate_ends_and_measures() {
        let r = super::crc_handed_over_rate(4);
        assert!(r.is_finite() && r > 0.0, "{r}");
        let none = super::crc_handed_over_rate(0);
        assert!(none.is_finite() && none >= 0.0, "{none}");
    }

    #[test]
    fn touching_fresh_pages_counts_minor_faults() {
        let before = super::minor_faults().expect("minflt in /proc/self/stat");
        // 8 MiB from the kernel (above glibc's default mmap threshold), every page written.
        let mut v = vec![0u8; 8 << 20];
        for page in v.chunks_mut(4096) {
            page[0] = 1;
        }
        std::hint::black_box(&v);
        let after = super::minor_faults().expect("minflt in /proc/self/stat");
        assert!(after > before, "{before} -> {after}");
        // Touching the same pages again takes none of them anew.
        let again = super::minor_faults().unwrap_or(0);
        for page in v.chunks_mut(4096) {
            page[1] = 2;
        }
        std::hint::black_box(&v);
        let last = super::minor_faults().unwrap_or(u64::MAX);
        // (Process-wide counts: other tests' threads may fault meanwhile, hence the margin.)
        assert!(
            last - again < (after - before) / 2,
            "first {before} -> {after}, again {again} -> {last}"
        );
    }
}
