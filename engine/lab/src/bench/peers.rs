//! `tl bench serve --peers`: `tl serve` beside llama.cpp's server (and vLLM's CPU build, when
//! one is given), each alone under the field's serving load, with the ratios against the better
//! peer.
//!
//! - The peer and the weights are `tl bench model`'s: the pinned `xllamacpp` wheel from PyPI
//!   (sha256-checked, under `target/peer`), and the trained model written as one BF16 GGUF that
//!   both servers load.
//! - The load is `peer/serve_load.py`: `vllm bench serve --backend openai-chat`'s rules (random
//!   prompts of about 256 tokens, 128 output tokens with `ignore_eos`, temperature 0, streamed,
//!   at most C in flight), stdlib only.
//! - Each server starts, takes every level of the load, and is stopped before the next starts.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::BenchError;

/// The load, written next to the peer's packages.
const LOAD: &str = include_str!("../../peer/serve_load.py");
/// llama.cpp's server, likewise.
const LLAMA_SERVER: &str = include_str!("../../peer/llamaserver.py");
/// The longest a server may take to say where it listens.
const START_DEADLINE: Duration = Duration::from_secs(300);
/// The longest one server's whole load may take.
const LOAD_DEADLINE: Duration = Duration::from_secs(3600);

/// What the comparison runs.
#[derive(Clone, Debug)]
pub struct PeersArgs {
    /// The trained model (a GGUF file).
    pub source: PathBuf,
    /// Levels of concurrency, e.g. `1,4,16`.
    pub concurrency: String,
    /// Servers among `tl`, `tl-colocated`, `llama-server`, `vllm`.
    pub servers: Vec<String>,
    /// Threads every server runs.
    pub threads: usize,
    /// vLLM's CPU build: a virtualenv holding it, and the same weights as a safetensors
    /// directory (not installed here: several GB).
    pub vllm: Option<(PathBuf, PathBuf)>,
}

/// A server started for the load, stopped when dropped.
struct Running {
    child: Child,
    base: String,
    model: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        // SIGTERM first (tl serve drains and removes its certificates), then SIGKILL.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The first JSON line `child` prints, within [`START_DEADLINE`].
fn listening(child: &mut Child, name: &str) -> Result<Value, BenchError> {
    let out = child.stdout.take().ok_or("no stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with('{') {
                let _ = tx.send(line);
            }
        }
    });
    let line = rx
        .recv_timeout(START_DEADLINE)
        .map_err(|_| format!("{name} did not say where it listens within {START_DEADLINE:?}"))?;
    Ok(serde_json::from_str(&line)?)
}

/// Starts `server` on `gguf`.
fn start(
    server: &str,
    a: &PeersArgs,
    gguf: &Path,
    site: &Path,
    dir: &Path,
) -> Result<Running, BenchError> {
    let threads = a.threads.to_string();
    let log = |what: &str| std::fs::File::create(dir.join(format!("{server}.{what}")));
    let mut child = match server {
        "tl" | "tl-colocated" => {
            let mut c = Command::new(std::env::current_exe()?);
            c.args(["serve", "--port", "0", "--threads", &threads])
                .arg("--model")
                .arg(gguf);
            if server == "tl-colocated" {
                c.arg("--colocated");
            }
            c.stdout(Stdio::piped()).stderr(log("err")?).spawn()?
        }
        "llama-server" => Command::new("python3")
            .env("PYTHONPATH", site)
            .env("PYTHONNOUSERSITE", "1")
            .arg(dir.join("llamaserver.py"))
            .arg(gguf)
            .args([threads.as_str(), "64", "512"])
            .stdout(Stdio::piped())
            .stderr(log("err")?)
            .spawn()?,
        "vllm" => {
            let (venv, hf) = a
                .vllm
                .as_ref()
                .ok_or("vllm needs --vllm-venv and --vllm-model")?;
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let child = Command::new(venv.join("bin/vllm"))
                .env("VLLM_TARGET_DEVICE", "cpu")
                .env("VLLM_CPU_KVCACHE_SPACE", "4")
                .env(
                    "VLLM_CPU_OMP_THREADS_BIND",
                    format!("0-{}", a.threads.max(1) - 1),
                )
                .env("HF_HUB_OFFLINE", "1")
                .arg("serve")
                .arg(hf)
                .args([
                    "--dtype",
                    "bfloat16",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    &port.to_string(),
                ])
                .args(["--served-model-name", "smollm2", "--max-model-len", "2048"])
                .stdout(log("out")?)
                .stderr(log("err")?)
                .spawn()?;
            let base = format!("http://127.0.0.1:{port}/v1");
            let mut r = Running {
                child,
                base,
                model: "smollm2".into(),
            };
            let until = Instant::now() + START_DEADLINE;
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                if Instant::now() > until || matches!(r.child.try_wait(), Ok(Some(_))) {
                    return Err("vLLM did not start".into());
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            // Its port opens before its model is loaded: the load's first request waits.
            return Ok(r);
        }
        other => {
            return Err(
                format!("unknown server {other:?}: tl, tl-colocated, llama-server, vllm").into(),
            );
        }
    };
    let line = listening(&mut child, server)?;
    let base = line["base_url"].as_str().ok_or("no base_url")?.to_owned();
    let model = line["model"].as_str().unwrap_or("smollm2").to_owned();
    Ok(Running { child, base, model })
}

/// The load's JSON lines against `r`.
fn load(r: &Running, a: &PeersArgs, dir: &Path, server: &str) -> Result<Vec<Value>, BenchError> {
    let out_path = dir.join(format!("{server}.load"));
    let mut child = Command::new("python3")
        .env("PYTHONNOUSERSITE", "1")
        .arg(dir.join("serve_load.py"))
        .args([&r.base, &r.model])
        .args([
            "--concurrency",
            &a.concurrency,
            "--prompts-per-level",
            "2",
            "--min-prompts",
            "8",
        ])
        .args(["--pid", &r.child.id().to_string()])
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(
            dir.join(format!("{server}.load.err")),
        )?)
        .spawn()?;
    let until = Instant::now() + LOAD_DEADLINE;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            return Err(
                format!("the load on {server} did not end within {LOAD_DEADLINE:?}").into(),
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if !status.success() {
        return Err(format!("the load on {server} failed ({status})").into());
    }
    Ok(std::fs::read_to_string(&out_path)?
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("concurrency").is_some())
        .collect())
}

/// Runs the comparison and returns its JSON.
///
/// # Errors
/// A peer that cannot be installed or started, a load that fails.
pub fn compare(a: &PeersArgs) -> Result<Value, BenchError> {
    let peer = super::peer::Peer::prepare(&a.source)?;
    let gguf = peer.files[0].clone(); // BF16, the first of TYPES
    let dir = super::peer::dir().join("serve");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("serve_load.py"), LOAD)?;
    std::fs::write(dir.join("llamaserver.py"), LLAMA_SERVER)?;
    let mut rows = Vec::new();
    for server in &a.servers {
        eprintln!("serving load on {server}");
        let r = start(server, a, &gguf, peer.site(), &dir)?;
        for mut level in load(&r, a, &dir, server)? {
            level["server"] = json!(server);
            rows.push(level);
        }
        drop(r);
    }
    Ok(json!({
        "bench": "serve_peers",
        "cpu": super::cpu_json(),
        "isa": tl_llama::kernels::simd::isa(),
        "weights": gguf.display().to_string(),
        "peer": "llama.cpp server (xllamacpp 2026.10.11549, its CPU wheel)",
        "rows": rows,
        "ratios": ratios(&rows),
    }))
}

/// Each `tl` server's output tokens/s and TTFT p50 over the better peer's at each level.
fn ratios(rows: &[Value]) -> Value {
    let is_peer = |r: &&Value| !r["server"].as_str().unwrap_or("").starts_with("tl");
    let mut out = serde_json::Map::new();
    for ours in rows.iter().filter(|r| !is_peer(r)) {
        let c = &ours["concurrency"];
        let peers: Vec<&Value> = rows
            .iter()
            .filter(is_peer)
            .filter(|r| &r["concurrency"] == c)
            .collect();
        let best_tps = peers
            .iter()
            .filter_map(|p| p["output_tok_s"].as_f64())
            .fold(f64::NAN, f64::max);
        let best_ttft = peers
            .iter()
            .filter_map(|p| p["ttft_ms"]["p50"].as_f64())
            .fold(f64::NAN, f64::min);
        let name = format!("{}_c{}", ours["server"].as_str().unwrap_or("tl"), c);
        out.insert(
            name,
            json!({
                "output_tok_s_over_best_peer": ours["output_tok_s"].as_f64().map(|v| super::round3(v / best_tps)),
                "ttft_p50_over_best_peer": ours["ttft_ms"]["p50"].as_f64().map(|v| super::round3(v / best_ttft)),
            }),
        );
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ratios are ours over the better peer: the higher throughput, the lower TTFT.
    #[test]
    fn ratios_take_the_better_peer() {
        let row = |s: &str, c: u32, tps: f64, ttft: f64| json!({"server": s, "concurrency": c, "output_tok_s": tps, "ttft_ms": {"p50": ttft}});
        let rows = [
            row("tl", 4, 60.0, 100.0),
            row("llama-server", 4, 50.0, 200.0),
            row("vllm", 4, 40.0, 50.0),
        ];
        let r = ratios(&rows);
        assert_eq!(r["tl_c4"]["output_tok_s_over_best_peer"], json!(1.2));
        assert_eq!(r["tl_c4"]["ttft_p50_over_best_peer"], json!(2.0));
    }
}
