//! Quick benchmarks that print one JSON line: figures are ratios against baselines measured in
//! the same run, interleaved, because absolute speeds on a shared machine drift.

use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvwire::{Reader, RecordIn, Shape, crc32c, write_envelope};

/// Arguments of `tl bench wire`.
#[derive(clap::Args, Debug)]
pub struct WireArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    pub json: bool,
    /// Interleaved rounds per measurement; the median is reported.
    #[arg(long, default_value_t = 7)]
    pub rounds: u32,
    /// Milliseconds per measurement in each round.
    #[arg(long, default_value_t = 120)]
    pub ms: u64,
}

/// Runs `f` repeatedly for about `budget` and returns GB/s for `bytes` per call.
pub fn gbps(bytes: usize, budget: Duration, mut f: impl FnMut()) -> f64 {
    // Calibrate the batch so clock reads are negligible.
    let mut batch = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..batch {
            f();
        }
        if t.elapsed() >= Duration::from_millis(2) || batch >= 1 << 30 {
            break;
        }
        batch *= 2;
    }
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < budget {
        for _ in 0..batch {
            f();
        }
        calls += batch;
    }
    (bytes as f64 * calls as f64) / start.elapsed().as_secs_f64() / 1e9
}

/// The median of `v` (which it sorts).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// One size's figures.
fn wire_case(name: &str, shape: Shape, rounds: u32, budget: Duration) -> serde_json::Value {
    let p = shape.payload_bytes().unwrap_or(0);
    let payload: Vec<u8> = (0..p).map(|i| (i * 31 % 251) as u8).collect();
    let rec = [RecordIn {
        hash: 0x1234,
        fill: shape.block_tokens(),
        payload: &payload,
    }];
    let mut env = Vec::new();
    let _ = kvwire::write_to_vec(&shape, &rec, &mut env);
    let len = env.len();
    let reader = Reader::new().expect_shape(shape);
    let mut out = Vec::with_capacity(len);
    let mut dst = vec![0u8; len];

    let (mut crc, mut read, mut copy_crc, mut write) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        crc.push(gbps(len, budget, || {
            black_box(crc32c(black_box(&env[..len - 4])));
        }));
        read.push(gbps(len, budget, || {
            if let Ok(e) = reader.read(black_box(&env)) {
                black_box(e.records().map(|r| r.payload.len()).sum::<usize>());
            }
        }));
        copy_crc.push(gbps(len, budget, || {
            dst.copy_from_slice(black_box(&env));
            black_box(crc32c(&dst[..len - 4]));
        }));
        write.push(gbps(len, budget, || {
            out.clear();
            let _ = black_box(write_envelope(&shape, black_box(&rec), &mut out));
        }));
    }
    let ratios = |a: &[f64], b: &[f64]| {
        let mut r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
        median(&mut r)
    };
    serde_json::json!({
        "case": name,
        "envelope_bytes": len,
        "crc_gbps": round3(median(&mut crc.clone())),
        "read_gbps": round3(median(&mut read.clone())),
        "read_over_crc": round3(ratios(&read, &crc)),
        "memcpy_crc_gbps": round3(median(&mut copy_crc.clone())),
        "write_gbps": round3(median(&mut write.clone())),
        "write_over_memcpy_crc": round3(ratios(&write, &copy_crc)),
    })
}

/// Runs `tl bench wire`.
#[must_use]
pub fn wire(args: &WireArgs) -> ExitCode {
    let t = Instant::now();
    let budget = Duration::from_millis(args.ms.max(1));
    let rounds = args.rounds.max(1);
    let cases = vec![
        wire_case("test_shape_172B", Shape::v1(4, 2, 1, 4), rounds, budget),
        wire_case("realistic_2MiB", Shape::v1(16, 32, 8, 128), rounds, budget),
    ];
    let out = serde_json::json!({
        "bench": "wire",
        "crc_impl": kvwire::crc32c_impl(),
        "rounds": rounds,
        "ratio": "median of per-round ratios, baseline measured in the same round",
        "cases": cases,
        "elapsed_s": round3(t.elapsed().as_secs_f64()),
    });
    println!("{out}");
    ExitCode::SUCCESS
}

/// Arguments of `tl bench transfer`.
#[derive(clap::Args, Debug)]
pub struct TransferArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    pub json: bool,
    /// MiB pushed per run (realistic-shape blocks of 2 MiB).
    #[arg(long, default_value_t = 256)]
    pub mib: usize,
    /// gRPC / raw TCP pairs, interleaved.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
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
fn filled_pool(shape: kvwire::Shape, n: usize) -> (crate::pool::SharedKv, Vec<u32>, Vec<u64>) {
    use crate::pool::{KvPool, SharedKv};
    let pool = SharedKv::new(KvPool::new(shape, n));
    let mut hashes = Vec::with_capacity(n);
    let ids = {
        let mut p = pool.lock();
        let ids = p.allocate(n).unwrap_or_default();
        let mut parent = 0;
        for (i, &id) in ids.iter().enumerate() {
            if let Ok(bytes) = p.payload_mut(id) {
                for (j, b) in bytes.iter_mut().enumerate() {
                    *b = (i * 131 + j * 7) as u8;
                }
            }
            let _ = p.set_fill(id, shape.block_tokens());
            let tokens: Vec<u32> = (0..shape.block_tokens())
                .map(|t| (i as u32) * 1000 + t)
                .collect();
            parent = kvwire::block_hash(parent, &tokens);
            p.register(id, parent);
            hashes.push(parent);
        }
        ids
    };
    (pool, ids, hashes)
}

/// Touches every byte of a pool's slabs so that RSS measured afterwards shows only buffers.
fn pretouch(pool: &crate::pool::SharedKv) {
    let mut p = pool.lock();
    let n = p.counts().total;
    if let Ok(ids) = p.allocate(n) {
        for &id in &ids {
            if let Ok(b) = p.payload_mut(id) {
                b.fill(1);
            }
        }
        for id in ids {
            let _ = p.release(id);
        }
    }
}

async fn tcp_run(bytes_total: usize, chunk: &[u8]) -> std::io::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
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
        Ok::<usize, std::io::Error>(got)
    });
    let start = Instant::now();
    let mut c = tokio::net::TcpStream::connect(addr).await?;
    c.set_nodelay(true)?;
    let mut sent = 0;
    while sent < bytes_total {
        let n = chunk.len().min(bytes_total - sent);
        c.write_all(&chunk[..n]).await?;
        sent += n;
    }
    let mut ack = [0u8; 1];
    c.read_exact(&mut ack).await?;
    let secs = start.elapsed().as_secs_f64();
    let got = server.await.map_err(std::io::Error::other)??;
    if got != bytes_total {
        return Err(std::io::Error::other("short TCP read"));
    }
    Ok(bytes_total as f64 / secs / 1e9)
}

/// Runs `tl bench transfer`.
#[must_use]
pub fn transfer(args: &TransferArgs) -> ExitCode {
    crate::serve::block_on(async { crate::serve::print_json(transfer_bench(args).await) })
}

async fn transfer_bench(args: &TransferArgs) -> Result<serde_json::Value, String> {
    use std::sync::Arc;

    use kvwire_grpc::{GrpcTransport, KvReceiver, KvStore, TransportConfig, serve_kv};

    let shape = kvwire::Shape::v1(16, 32, 8, 128);
    let p_bytes = shape.payload_bytes().ok_or("shape overflows")?;
    let n = (args.mib << 20).div_ceil(p_bytes).max(1);
    let (src_pool, ids, hashes) = filled_pool(shape, n);
    let dst_pool = crate::pool::SharedKv::new(crate::pool::KvPool::new(shape, n));
    pretouch(&dst_pool);
    let dst_store: Arc<dyn KvStore> = Arc::new(dst_pool.clone());
    let src_store: Arc<dyn KvStore> = Arc::new(src_pool.clone());
    let rx = Arc::new(KvReceiver::new(Arc::clone(&dst_store), "fake"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let server = serve_kv(listener, Arc::clone(&rx)).map_err(|e| e.to_string())?;
    let target = server.local_addr().to_string();
    let transport = GrpcTransport::new(TransportConfig::for_envelope(
        shape.envelope_len(1).ok_or("overflow")?,
    ));
    let tcp_chunk = vec![7u8; shape.envelope_len(1).ok_or("overflow")?];

    // One push; the decode side then frees and unregisters what it received, so the next run
    // moves every block again.
    let push = |handle: String, count: usize| {
        let (transport, src_store, rx, dst_store, target) =
            (&transport, &src_store, &rx, &dst_store, &target);
        let (ids, hashes) = (&ids[..count], &hashes[..count]);
        async move {
            let start = Instant::now();
            let st = kvwire_grpc::transfer(
                transport,
                target,
                Arc::clone(src_store),
                &handle,
                "fake",
                ids,
                hashes,
            )
            .await
            .map_err(|e| e.to_string())?;
            let secs = start.elapsed().as_secs_f64();
            if let Some(c) = rx.claim(&handle) {
                dst_store.release_forget(&c.into_ids());
            }
            Ok::<_, String>((st, secs))
        }
    };

    // Warm-up: connections, allocator.
    push("warm".into(), n.min(4)).await?;
    let (mut grpc, mut tcp, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..args.runs.max(1) {
        let (st, secs) = push(format!("run-{run}"), n).await?;
        let g = st.payload_bytes as f64 / secs / 1e9;
        let t = tcp_run(st.payload_bytes as usize, &tcp_chunk)
            .await
            .map_err(|e| e.to_string())?;
        grpc.push(g);
        tcp.push(t);
        ratios.push(g / t);
    }

    // Peak RSS growth during a push, for a quarter of the blocks and for all of them (pools are
    // already resident, so growth is the transfer's own buffering).
    let mut rss_growth = serde_json::Map::new();
    for count in [n.div_ceil(4), n] {
        let before = rss().map(|r| r.1);
        let reset = reset_peak_rss();
        push(format!("rss-{count}"), count).await?;
        let after = rss().map(|r| r.0);
        if let (true, Some(b), Some(a)) = (reset, before, after) {
            let key = format!("push_{}_mib", (count * p_bytes) >> 20);
            rss_growth.insert(
                key,
                serde_json::json!(round3(a.saturating_sub(b) as f64 / (1 << 20) as f64)),
            );
        }
    }

    // Dedup saving: the decode side already holds the first 75% of the prompt.
    let cached = n * 3 / 4;
    // Push the prefix and release it normally, so its blocks stay cached on the decode side.
    let st_prefix = kvwire_grpc::transfer(
        &transport,
        &target,
        Arc::clone(&src_store),
        "prefix",
        "fake",
        &ids[..cached],
        &hashes[..cached],
    )
    .await
    .map_err(|e| e.to_string())?;
    rx.release("prefix");
    let start = Instant::now();
    let st75 = kvwire_grpc::transfer(
        &transport,
        &target,
        Arc::clone(&src_store),
        "dedup",
        "fake",
        &ids,
        &hashes,
    )
    .await
    .map_err(|e| e.to_string())?;
    let secs75 = start.elapsed().as_secs_f64();
    if let Some(c) = rx.claim("dedup") {
        dst_store.release(&c.into_ids());
    }
    let full_bytes = n as u64 * (shape.envelope_len(1).unwrap_or(0) as u64);
    drop(server);

    Ok(serde_json::json!({
        "bench": "transfer",
        "shape": "B=16 L=32 H=8 D=128 (2 MiB blocks)",
        "blocks_per_push": n,
        "push_mib": round3((n * p_bytes) as f64 / (1 << 20) as f64),
        "runs": grpc.len(),
        "grpc_gbps": round3(median(&mut grpc.clone())),
        "tcp_gbps": round3(median(&mut tcp.clone())),
        "grpc_over_tcp": round3(median(&mut ratios.clone())),
        "grpc_gbps_all": grpc.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
        "tcp_gbps_all": tcp.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
        "peak_rss_growth_mib": rss_growth,
        "dedup_75pct_cached": {
            "prefix_blocks_sent_first": st_prefix.sent,
            "blocks_sent": st75.sent,
            "blocks_deduped": st75.deduped,
            "payload_bytes": st75.payload_bytes,
            "full_payload_bytes": full_bytes,
            "bytes_saved_fraction": round3(1.0 - st75.payload_bytes as f64 / full_bytes as f64),
            "seconds": round3(secs75),
        },
        "crc_impl": kvwire::crc32c_impl(),
    }))
}

/// Arguments of `tl bench ttft`.
#[derive(clap::Args, Debug)]
pub struct TtftArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    pub json: bool,
    /// Prompt sizes, in blocks of 16 tokens at the realistic shape.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 256])]
    pub blocks: Vec<usize>,
}

/// Runs `tl bench ttft`.
#[must_use]
pub fn ttft(args: &TtftArgs) -> ExitCode {
    crate::serve::block_on(async { crate::serve::print_json(ttft_bench(args).await) })
}

fn ms(d: Duration) -> f64 {
    round3(d.as_secs_f64() * 1e3)
}

async fn ttft_bench(args: &TtftArgs) -> Result<serde_json::Value, String> {
    use std::sync::Arc;

    use kvwire_grpc::pb::kv::HasBlocksRequest;
    use kvwire_grpc::{GrpcTransport, KvStore, KvTransport, TransportConfig};

    use crate::config::{Config, Role};
    use crate::engine::{Engine, Event, Mode, Request};
    use crate::node::EngineNode;
    use crate::sampler::Sampling;

    let mut rows = Vec::new();
    for &n in &args.blocks {
        let mut cfg = Config::default();
        cfg.model.n_layers = 32;
        cfg.model.n_kv_heads = 8;
        cfg.model.head_dim = 128;
        cfg.model.max_context = 16 * (n as u32 + 8);
        cfg.pool.block_tokens = 16;
        cfg.pool.n_blocks = n as u32 + 8;
        cfg.engine.role = Role::Decode;
        cfg.validate().map_err(|e| e.to_string())?;
        let shape = cfg.shape();
        let prompt: Vec<u32> = (0..n * 16).map(|i| (i * 7 % 251) as u32).collect();
        let req = |mode| Request {
            prompt: prompt.clone(),
            sampling: Sampling::GREEDY,
            seed: 1,
            max_tokens: 1,
            mode,
        };

        // Colocated: prefill and first token on one engine.
        let mut solo = Engine::new(cfg.build_model(), cfg.build_pool());
        let t = Instant::now();
        let colocated_first = solo
            .generate(req(Mode::Generate))
            .map_err(|e| e.to_string())?;
        let colocated = t.elapsed();
        drop(solo);

        // Disaggregated, step by step: prefill here, transfer to a decode engine, resume there.
        let d = EngineNode::start(&cfg).await.map_err(|e| e.to_string())?;
        let kv = d.addresses().kv;
        let mut p = Engine::new(cfg.build_model(), cfg.build_pool());
        let t = Instant::now();
        p.submit(req(Mode::PrefillOnly))
            .map_err(|e| e.to_string())?;
        let out = p
            .step()
            .0
            .into_iter()
            .find_map(|e| match e {
                Event::Prefilled { output, .. } => Some(output),
                _ => None,
            })
            .ok_or("prefill produced no output")?;
        let prefill = t.elapsed();
        let transport = GrpcTransport::new(TransportConfig::for_envelope(
            shape.envelope_len(1).unwrap_or(0),
        ));
        // Connect once outside the measurement, as a long-running prefill engine would have.
        let warm = HasBlocksRequest {
            hashes: vec![1],
            kv_format: 1,
            model: "fake".into(),
        };
        transport
            .has_blocks(&kv, warm)
            .await
            .map_err(|e| e.to_string())?;
        let t = Instant::now();
        let hb = HasBlocksRequest {
            hashes: out.hashes.clone(),
            kv_format: 1,
            model: "fake".into(),
        };
        transport
            .has_blocks(&kv, hb)
            .await
            .map_err(|e| e.to_string())?;
        let has_blocks = t.elapsed();
        let store: Arc<dyn KvStore> = Arc::new(p.pool().clone());
        let t = Instant::now();
        let st = kvwire_grpc::transfer(
            &transport,
            &kv,
            store,
            "ttft",
            "fake",
            out.blocks.ids(),
            &out.hashes,
        )
        .await
        .map_err(|e| e.to_string())?;
        let transfer = t.elapsed();
        let first = out.first_token;
        drop(out);
        let body = serde_json::json!({
            "prompt": prompt, "max_tokens": 2, "seed": 1, "tl_resume": { "first_token": first, "rng_draws_consumed": 0 },
        });
        let t = Instant::now();
        let r = crate::client::HttpClient::default()
            .post(
                &d.addresses().http,
                "/v1/completions",
                &[("x-tl-kv-handle", "ttft")],
                body.to_string(),
            )
            .await?;
        let resume = t.elapsed();
        if r.status != 200 {
            return Err(format!("resume answered {}", r.status));
        }
        d.shutdown(Duration::from_secs(1)).await;
        let disagg = prefill + transfer;
        rows.push(serde_json::json!({
            "blocks": n,
            "prompt_tokens": n * 16,
            "payload_mib": round3(st.payload_bytes as f64 / (1 << 20) as f64),
            "colocated_ttft_ms": ms(colocated),
            "prefill_ms": ms(prefill),
            "has_blocks_ms": ms(has_blocks),
            "push_ms": ms(transfer.saturating_sub(has_blocks)),
            "disaggregated_ttft_ms": ms(disagg),
            "ttft_ratio": round3(disagg.as_secs_f64() / colocated.as_secs_f64()),
            "resume_first_decode_ms": ms(resume),
            "first_token_equal": colocated_first.first() == Some(&first),
        }));
    }
    Ok(serde_json::json!({
        "bench": "ttft",
        "shape": "B=16 L=32 H=8 D=128 (2 MiB blocks), fake model, greedy",
        "note": "disaggregated TTFT = prefill + HasBlocks + push (the first token returns with the KvHandle); resume = claim + one decode step + HTTP",
        "rows": rows,
    }))
}

/// Arguments of `tl bench serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Print the result as one JSON line (the only output format).
    #[arg(long)]
    pub json: bool,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Requests in all.
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Fraction of requests with a long prompt.
    #[arg(long, default_value_t = 0.1)]
    pub long_fraction: f64,
    /// Tokens of a long prompt.
    #[arg(long, default_value_t = 1024)]
    pub long_tokens: usize,
    /// Tokens of a short prompt.
    #[arg(long, default_value_t = 64)]
    pub short_tokens: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Simulated prefill cost per prompt token, microseconds.
    #[arg(long, default_value_t = 50)]
    pub prefill_us_per_token: u64,
    /// Simulated decode cost per running sequence per step, microseconds.
    #[arg(long, default_value_t = 300)]
    pub decode_us_per_seq: u64,
}

/// One request's timings.
#[derive(Clone, Copy, Debug, Default)]
struct Timing {
    ttft: f64,
    tpot: Option<f64>,
    tokens: usize,
}

async fn one_streamed(
    http: &crate::client::HttpClient,
    addr: &str,
    body: String,
) -> Result<Timing, String> {
    use http_body_util::BodyExt;
    let start = Instant::now();
    let (status, mut body) = http
        .post_streaming(addr, "/v1/completions", &[], body)
        .await?;
    if status != 200 {
        let text = body
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        return Err(format!("answered {status}: {text}"));
    }
    let (mut first, mut last, mut tokens, mut buf) = (None, None, 0usize, String::new());
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(|e| e.to_string())?.into_data() else {
            continue;
        };
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for d in event
                .lines()
                .filter_map(|l| l.strip_prefix("data:").map(str::trim))
            {
                if d == "[DONE]" {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(d).map_err(|e| e.to_string())?;
                if v.get("error").is_some() {
                    return Err(v.to_string());
                }
                let n = v["choices"][0]["tokens"].as_array().map_or(0, Vec::len);
                if n > 0 {
                    let now = start.elapsed().as_secs_f64();
                    first.get_or_insert(now);
                    last = Some(now);
                    tokens += n;
                }
            }
        }
    }
    let ttft = first.ok_or("no token")?;
    let tpot = match (last, tokens) {
        (Some(l), n) if n > 1 => Some((l - ttft) / (n - 1) as f64),
        _ => None,
    };
    Ok(Timing { ttft, tpot, tokens })
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Runs the load against `addr` and summarises it.
async fn load(addr: &str, a: &ServeArgs) -> Result<serde_json::Value, String> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..a.clients.max(1) {
        let (next, addr, a) = (Arc::clone(&next), addr.to_owned(), a.clone());
        tasks.push(tokio::spawn(async move {
            let http = crate::client::HttpClient::default();
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= a.requests {
                    break;
                }
                // Every 1/fraction-th request is long, spread evenly over the run.
                let every = (1.0 / a.long_fraction.max(1e-9)).round().max(1.0) as usize;
                let long = a.long_fraction > 0.0 && i % every == every / 2;
                let n = if long { a.long_tokens } else { a.short_tokens };
                let prompt: Vec<u32> = (0..n).map(|t| ((t * 31 + i * 7) % 256) as u32).collect();
                let body = serde_json::json!({ "prompt": prompt, "max_tokens": a.max_tokens, "stream": true, "seed": i });
                out.push((long, one_streamed(&http, &addr, body.to_string()).await));
            }
            out
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await.map_err(|e| e.to_string())?);
    }
    let wall = start.elapsed().as_secs_f64();
    let mut ttft = Vec::new();
    let mut tpot = Vec::new();
    let (mut tokens, mut errors) = (0usize, 0usize);
    let mut first_error = None;
    for (_, r) in &results {
        match r {
            Ok(t) => {
                ttft.push(t.ttft * 1e3);
                if let Some(p) = t.tpot {
                    tpot.push(p * 1e3);
                }
                tokens += t.tokens;
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert_with(|| e.clone());
            }
        }
    }
    Ok(serde_json::json!({
        "requests": results.len(),
        "errors": errors,
        "first_error": first_error,
        "ttft_ms_p50": round3(pct(&mut ttft, 50.0)),
        "ttft_ms_p99": round3(pct(&mut ttft, 99.0)),
        "tpot_ms_p50": round3(pct(&mut tpot, 50.0)),
        "tpot_ms_p99": round3(pct(&mut tpot, 99.0)),
        "tokens_per_s": round3(tokens as f64 / wall),
        "wall_s": round3(wall),
    }))
}

/// Runs `tl bench serve`.
#[must_use]
pub fn serve(args: &ServeArgs) -> ExitCode {
    crate::serve::block_on(async { crate::serve::print_json(serve_bench(args).await) })
}

async fn serve_bench(a: &ServeArgs) -> Result<serde_json::Value, String> {
    use crate::config::{Config, Role};
    use crate::gateway::{GatewayNode, GatewaySection};
    use crate::node::EngineNode;

    let cfg = |id: &str, role: Role, reg: &str| {
        let mut c = Config::for_worker(id, role, reg);
        c.engine.heartbeat_ms = 100;
        c.model.prefill_us_per_token = a.prefill_us_per_token;
        c.model.decode_us_per_seq = a.decode_us_per_seq;
        c.pool.n_blocks = 8192;
        c
    };
    // (a) The gateway over one prefill and two decode engines.
    let gw = GatewayNode::start(&GatewaySection {
        max_inflight: 4096,
        ..GatewaySection::default()
    })
    .await
    .map_err(|e| e.to_string())?;
    let reg = gw.registry_addr().to_string();
    let nodes = [
        EngineNode::start(&cfg("P", Role::Prefill, &reg))
            .await
            .map_err(|e| e.to_string())?,
        EngineNode::start(&cfg("D1", Role::Decode, &reg))
            .await
            .map_err(|e| e.to_string())?,
        EngineNode::start(&cfg("D2", Role::Decode, &reg))
            .await
            .map_err(|e| e.to_string())?,
    ];
    let end = Instant::now() + Duration::from_secs(10);
    while gw.registry().list(Instant::now()).len() < 3 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let disagg = load(&gw.http_addr().to_string(), a).await?;
    for n in nodes {
        n.shutdown(Duration::from_secs(1)).await;
    }
    gw.stop().await;
    // (b) One engine with role both, alone.
    let single = EngineNode::start(&cfg("B", Role::Both, ""))
        .await
        .map_err(|e| e.to_string())?;
    let colocated = load(&single.addresses().http, a).await?;
    single.shutdown(Duration::from_secs(1)).await;
    let ratio = |k: &str| {
        round3(disagg[k].as_f64().unwrap_or(f64::NAN) / colocated[k].as_f64().unwrap_or(f64::NAN))
    };
    Ok(serde_json::json!({
        "bench": "serve",
        "settings": {
            "clients": a.clients, "requests": a.requests, "long_fraction": a.long_fraction, "long_tokens": a.long_tokens,
            "short_tokens": a.short_tokens, "max_tokens": a.max_tokens,
            "prefill_us_per_token": a.prefill_us_per_token, "decode_us_per_seq": a.decode_us_per_seq,
            "shape": "test shape B=4 L=2 H=1 D=4, fake model, cost model by sleeping in the step loop",
        },
        "disaggregated_gateway_1p_2d": disagg,
        "single_engine_both": colocated,
        "disagg_over_single": {
            "tpot_ms_p99": ratio("tpot_ms_p99"),
            "tpot_ms_p50": ratio("tpot_ms_p50"),
            "ttft_ms_p99": ratio("ttft_ms_p99"),
            "tokens_per_s": ratio("tokens_per_s"),
        },
    }))
}
