//! What every drill is made of: child processes killed on drop, the compose project, engine
//! configurations and certificates, prompts and their colocated answers, and metrics scraped
//! from the processes.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tl_engine::net::clients::HttpClient;
use tl_engine::node::config::Config;
use tl_engine_core::rng::stream;
use tl_engine_core::sampler::SamplingRequest;

use super::args::DrillArgs;
use super::error::DrillError;

/// A child process of the drill, killed on drop.
pub struct Proc {
    pub(crate) child: Child,
    listening: Value,
    _stdout: BufReader<ChildStdout>,
}

impl Proc {
    pub fn start(args: &[&str], log: &Path) -> Result<Self, DrillError> {
        Self::start_in(&[], args, log)
    }

    /// `tl args...`, run through `prefix` (for instance `ip netns exec NS`) when given.
    pub(super) fn start_in(
        prefix: &[String],
        args: &[&str],
        log: &Path,
    ) -> Result<Self, DrillError> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let stderr = std::fs::File::create(log).map_err(|e| e.to_string())?;
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("spawning tl {args:?}: {e}"))?;
        let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        out.read_line(&mut line).map_err(|e| e.to_string())?;
        let listening: Value = serde_json::from_str(&line)
            .map_err(|e| format!("tl {args:?} printed {line:?}: {e} (log: {})", log.display()))?;
        Ok(Self {
            child,
            listening,
            _stdout: out,
        })
    }

    pub fn addr(&self, key: &str) -> String {
        self.listening[key].as_str().unwrap_or_default().to_owned()
    }

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The prompts: one of three shared system prefixes, then a suffix of its own.
pub fn prompt(client: usize, n: usize) -> Vec<u32> {
    let mut rng = stream((client as u64) << 32 | n as u64, "drill");
    let system = (rng.next_u32() % 3) as u8;
    let mut p: Vec<u32> = format!("system prompt {system}: be brief and exact. ")
        .bytes()
        .map(u32::from)
        .collect();
    let extra = 5 + rng.next_u32() % 20;
    p.extend((0..extra).map(|_| 32 + rng.next_u32() % 90));
    p
}

pub fn colocated(prompt: &[u32], temperature: f32, seed: u64, max_tokens: u32) -> Vec<u32> {
    let s = SamplingRequest {
        temperature,
        ..SamplingRequest::default()
    };
    Config::default()
        .colocated(prompt, s, seed, max_tokens)
        .unwrap_or_default()
}

pub fn p99_ms(mut v: Vec<Duration>) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    v.sort();
    let i = ((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1;
    json!((v[i].as_secs_f64() * 1e5).round() / 100.0)
}

pub(super) fn p50_ms(mut v: Vec<Duration>) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    v.sort();
    json!((v[v.len() / 2].as_secs_f64() * 1e5).round() / 100.0)
}

/// The figures of one `GET /metrics`, by series (name and labels as printed).
pub(crate) async fn scrape(addr: &str) -> Option<BTreeMap<String, f64>> {
    let r = tokio::time::timeout(
        Duration::from_secs(2),
        HttpClient::default().get(addr, "/metrics"),
    )
    .await
    .ok()?
    .ok()?;
    (r.status == 200).then(|| {
        String::from_utf8_lossy(&r.body)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect()
    })
}

/// Blocks in use and handles pending, from an engine's metrics.
pub fn in_use(m: &BTreeMap<String, f64>) -> f64 {
    m.get("tl_pool_blocks{state=\"used\"}")
        .copied()
        .unwrap_or(0.0)
        + m.get("tl_kv_handles_pending").copied().unwrap_or(0.0)
}

pub fn engine_toml(
    dir: &Path,
    id: &str,
    role: &str,
    registry: &str,
    listen: &str,
    a: &DrillArgs,
) -> Result<PathBuf, DrillError> {
    let path = dir.join(format!("{id}.toml"));
    let decode = if role == "decode" { a.decode_us } else { 0 };
    // Across a cut link nothing answers: dead peers are found by keepalive within 1.5 s, and a
    // stalled push is undone by the receiver after 2 s.
    let text = format!(
        "[engine]\nid = \"{id}\"\nrole = \"{role}\"\ngateway_registry = \"{registry}\"\nheartbeat_ms = {hb}\n\
         grpc_listen = \"{listen}:0\"\nkv_listen = \"{listen}:0\"\nhttp_listen = \"{listen}:0\"\nmetrics_listen = \"{listen}:0\"\n\n\
         [model]\ndecode_us_per_seq = {decode}\nprefill_us_per_token = 20\n\n\
         [limits]\nkeepalive_ms = 500\nkeepalive_timeout_ms = 1000\npush_idle_ms = 2000\nhandle_lease_ms = 3000\n",
        hb = a.heartbeat_ms
    );
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    Ok(path)
}

/// `tl certs` for `id` (a CA made on first use in `dir/certs`), as the TLS flags naming it.
pub(super) fn certs(
    dir: &Path,
    id: &str,
    role: &str,
    hosts: &[String],
) -> Result<Vec<String>, DrillError> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let certs = dir.join("certs");
    let mut cmd = Command::new(exe);
    cmd.arg("certs")
        .arg("--dir")
        .arg(&certs)
        .args(["--id", id, "--role", role])
        // A restarted engine gets a fresh certificate of the same identity.
        .arg("--force");
    for h in hosts {
        cmd.args(["--host", h]);
    }
    sh(&mut cmd)?;
    let file = |ext: &str| {
        certs
            .join(format!("{id}.{ext}"))
            .to_string_lossy()
            .into_owned()
    };
    Ok(vec![
        "--tls-ca".into(),
        certs.join("ca.pem").to_string_lossy().into_owned(),
        "--tls-cert".into(),
        file("pem"),
        "--tls-key".into(),
        file("key"),
    ])
}

/// `program` under coreutils' `timeout`: a hung Docker daemon ends the drill with an error
/// after `seconds` instead of hanging it.
pub(super) fn bounded(program: &str, seconds: u32) -> Command {
    let mut c = Command::new("timeout");
    c.arg(seconds.to_string()).arg(program);
    c
}

/// Runs a command to completion; its stderr in the error. The runtime's other tasks (the
/// clients) move to another thread meanwhile.
pub(super) fn sh(cmd: &mut Command) -> Result<String, DrillError> {
    let what = format!("{cmd:?}");
    let out = tokio::task::block_in_place(|| cmd.stdin(Stdio::null()).output()).map_err(|e| {
        DrillError::Process {
            what: what.clone(),
            why: e.to_string(),
        }
    })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(DrillError::Process {
            what,
            why: format!("failed: {}", String::from_utf8_lossy(&out.stderr).trim()),
        })
    }
}

/// `deploy/compose.yaml` brought up under a project name of its own, taken down on drop.
pub struct Compose {
    file: PathBuf,
    project: String,
    /// The first gateway's published OpenAI endpoint.
    pub(crate) http: String,
    /// Container ids by service, read once after `up`: during the drill only the `docker` CLI
    /// runs (docker-compose is a Python program whose start-up takes a core for half a second,
    /// enough on a small host to slow the engines it is about to fault).
    ids: BTreeMap<&'static str, String>,
}

/// The services the drill touches.
pub(super) const SERVICES: [&str; 8] = [
    "gateway",
    "gateway-2",
    "prefill",
    "decode-1",
    "decode-2",
    "etcd-0",
    "etcd-1",
    "etcd-2",
];

impl Compose {
    pub(super) fn cmd(&self) -> Command {
        // `up` builds nothing (the image exists) but waits for health checks: 5 minutes at most.
        let mut c = bounded("docker-compose", 300);
        c.args(["-p", &self.project, "-f"]).arg(&self.file);
        c
    }

    pub(super) fn run(&self, args: &[&str]) -> Result<String, DrillError> {
        sh(self.cmd().args(args))
    }

    /// The project's private network.
    pub(super) fn network(&self) -> String {
        format!("{}_kv", self.project)
    }

    pub(super) fn id(&self, service: &str) -> Result<&str, DrillError> {
        self.ids
            .get(service)
            .map(String::as_str)
            .ok_or_else(|| DrillError::Fleet(format!("no container for {service}")))
    }

    /// `docker <args...> <service's container>`.
    pub fn docker(&self, args: &[&str], service: &str) -> Result<String, DrillError> {
        sh(bounded("docker", 60).args(args).arg(self.id(service)?))
    }

    /// `docker <args...> <each service's container>`, in one command (killing three
    /// containers one `docker` call after the other takes seconds).
    pub fn docker_all(&self, args: &[&str], services: &[&str]) -> Result<String, DrillError> {
        let ids = services
            .iter()
            .map(|s| self.id(s))
            .collect::<Result<Vec<_>, _>>()?;
        sh(bounded("docker", 60).args(args).args(ids))
    }

    /// The host address a service's container port is published on.
    pub fn port(&self, service: &str, port: u16) -> Option<String> {
        let id = self.id(service).ok()?;
        let p = sh(bounded("docker", 60).args(["port", id, &port.to_string()])).ok()?;
        let p = p.lines().find(|l| l.starts_with("127.0.0.1:"))?.to_owned();
        (!p.ends_with(":0")).then_some(p)
    }

    pub fn up(image: &str, etcd_image: &str) -> Result<Self, DrillError> {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        let file = PathBuf::from(format!("{root}/deploy/compose.yaml"));
        sh(bounded("docker", 60).args(["image", "inspect", image]))
            .map_err(|_| format!("no image {image}: build it with deploy/build-image.sh"))?;
        sh(bounded("docker", 60).args(["image", "inspect", etcd_image])).map_err(|_| {
            format!("no image {etcd_image}: build it with deploy/build-etcd-image.sh")
        })?;
        // A free loopback port for the gateway's published endpoint.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let mut c = Self {
            file,
            project: format!("tldrill{}", std::process::id()),
            http: format!("127.0.0.1:{port}"),
            ids: BTreeMap::new(),
        };
        let mut up = c.cmd();
        up.env("TL_HTTP_PORT", port.to_string())
            .env("TL_IMAGE", image)
            .env("TL_ETCD_IMAGE", etcd_image)
            .args(["up", "-d"]);
        sh(&mut up)?;
        for s in SERVICES {
            let id = c.run(&["ps", "-q", s])?;
            c.ids.insert(s, id);
        }
        Ok(c)
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        if std::env::var_os("TL_DRILL_KEEP").is_some() {
            eprintln!("TL_DRILL_KEEP: leaving compose project {} up", self.project);
            return;
        }
        let _ = self.run(&["down", "-v", "--timeout", "5"]);
    }
}

/// A drill's timeline: it runs `total`, takes the fault at a third and restores it at two
/// thirds, counted from `t0`.
pub(super) struct Timeline {
    pub(super) t0: Instant,
    pub(super) total: Duration,
    pub(super) fault_at: Duration,
    pub(super) restore_at: Duration,
}

impl Timeline {
    /// A timeline of `seconds` (at least `at_least`), starting now.
    pub(super) fn start(seconds: f64, at_least: f64) -> Self {
        let total = Duration::from_secs_f64(seconds.max(at_least));
        Self {
            t0: Instant::now(),
            total,
            fault_at: total / 3,
            restore_at: total * 2 / 3,
        }
    }

    /// When the clients stop sending.
    pub(super) fn end(&self) -> Instant {
        self.t0 + self.total
    }
}

/// Starts `n` clients, client `i` running `client(i, outcomes)`, each pushing what it saw into
/// the one list of outcomes.
pub(super) fn start_clients<O, F, Fut>(
    n: usize,
    client: F,
) -> (Arc<Mutex<Vec<O>>>, tokio::task::JoinSet<()>)
where
    O: Send + 'static,
    F: Fn(usize, Arc<Mutex<Vec<O>>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..n {
        clients.spawn(client(i, Arc::clone(&outcomes)));
    }
    (outcomes, clients)
}

/// Client `i`'s `n`th request: its prompt, and its sampling, greedy and seeded by turns
/// (temperature, seed).
pub(super) fn nth_request(i: usize, n: usize) -> (Vec<u32>, f32, u64) {
    let (t, seed) = if (i + n).is_multiple_of(2) {
        (0.0, 0)
    } else {
        (0.8, (i * 10_000 + n) as u64)
    };
    (prompt(i, n), t, seed)
}
