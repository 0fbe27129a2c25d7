//! Chat templates rendered in processes of their own, bounded in memory and wall-clock time.
//!
//! A checkpoint's chat template is code, and a request's messages are its input. Fuel bounds
//! its instructions and the output writer bounds its text, but a template can take memory
//! without writing it (`{% set x = x ~ x %}` ten times over doubles a string each time), and
//! nothing inside one process can stop that short of the allocator failing, which aborts the
//! whole gateway. So the gateway renders in child processes (`tl __render-worker`):
//!
//! - each child limits its own address space (`RLIMIT_AS`) to what it had at start plus
//!   `template_memory_mib`, and writes no core file; a render past it ends that child only;
//! - the gateway kills a child whose render takes longer than `template_timeout_ms`;
//! - a render past either bound is refused as a bound ([`TextError::Bound`]), the child is
//!   reaped, and the next render starts a new one;
//! - children are kept and reused (at most one per concurrent render, which the gateway's
//!   `prep_threads` bounds), so a render costs one round trip over two pipes.
//!
//! The protocol is frames of a little-endian `u32` length and that many bytes of JSON: the
//! gateway sends [`Init`] once, then one [`Ask`] per render, and the child answers each with
//! one [`Answer`].

use std::io::{BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tl_llama::text::{ChatTemplate, RenderBounds};
use tl_llama::{Message, TextError};

/// The hidden `tl` subcommand a child runs.
pub const WORKER_ARG: &str = "__render-worker";

/// The largest frame either side reads: a request body is bounded far below it, and an
/// answer is the rendered text (at most `max_bytes`) escaped as JSON (at most 6 bytes a byte).
const MAX_FRAME: usize = 128 << 20;

/// What a child is told once, at start.
#[derive(Serialize, Deserialize)]
struct Init {
    source: String,
    bos: Option<String>,
    eos: Option<String>,
    fuel: u64,
    max_bytes: usize,
    memory_mib: u64,
}

/// One render.
#[derive(Serialize, Deserialize)]
struct Ask {
    messages: Vec<Message>,
    tools: Option<serde_json::Value>,
    add_generation_prompt: bool,
}

/// A render's outcome, and whether the child retires after it: one whose address space grew
/// past half its budget (a heap that a large render left mapped) ends, so that the next render,
/// maybe another tenant's, never starts with less than half the memory bound left.
#[derive(Serialize, Deserialize)]
struct Reply {
    answer: Answer,
    retire: bool,
}

/// A render's outcome.
#[derive(Serialize, Deserialize)]
enum Answer {
    Text(String),
    Template(String),
    Bound(String),
}

fn write_frame(w: &mut impl Write, v: &impl Serialize) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(v).map_err(std::io::Error::other)?;
    let len = u32::try_from(bytes.len()).map_err(std::io::Error::other)?;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(&bytes)?;
    w.flush()
}

/// One frame, or `None` at a clean end of the stream.
fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> std::io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "a frame of {len} bytes, past the bound of {MAX_FRAME}"
        )));
    }
    let mut buf = Vec::new();
    r.take(len as u64).read_to_end(&mut buf)?;
    if buf.len() != len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    serde_json::from_slice(&buf)
        .map(Some)
        .map_err(std::io::Error::other)
}

/// This process's virtual size in bytes (`VmSize` of `/proc/self/status`).
fn vm_size() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmSize:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The child's side: reads [`Init`] from stdin, limits its own memory, then answers each
/// [`Ask`] until stdin ends. Exit 0 at the end of stdin, 2 on a broken protocol.
#[must_use]
pub fn worker_main() -> ExitCode {
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    let Ok(Some(init)) = read_frame::<Init>(&mut input) else {
        return ExitCode::from(2);
    };
    let no_core = rustix::process::Rlimit {
        current: Some(0),
        maximum: Some(0),
    };
    let _ = rustix::process::setrlimit(rustix::process::Resource::Core, no_core);
    let Some(base) = vm_size() else {
        return ExitCode::from(2);
    };
    let cap = base.saturating_add(init.memory_mib.saturating_mul(1 << 20));
    let as_limit = rustix::process::Rlimit {
        current: Some(cap),
        maximum: Some(cap),
    };
    if rustix::process::setrlimit(rustix::process::Resource::As, as_limit).is_err() {
        return ExitCode::from(2);
    }
    let bounds = RenderBounds {
        fuel: init.fuel,
        max_bytes: init.max_bytes,
    };
    let template = match ChatTemplate::new(init.source, init.bos, init.eos, bounds) {
        Ok(t) => t,
        Err(e) => {
            let _ = write_frame(&mut output, &Answer::Template(e.to_string()));
            return ExitCode::from(2);
        }
    };
    // Ready: the parent's clock for a render starts after this.
    if write_frame(&mut output, &Answer::Text(String::new())).is_err() {
        return ExitCode::from(2);
    }
    loop {
        let ask = match read_frame::<Ask>(&mut input) {
            Ok(Some(a)) => a,
            Ok(None) => return ExitCode::SUCCESS,
            Err(_) => return ExitCode::from(2),
        };
        let answer = match template.render_tools(
            &ask.messages,
            ask.tools.as_ref(),
            ask.add_generation_prompt,
        ) {
            Ok(s) => Answer::Text(s),
            Err(TextError::Bound(m)) => Answer::Bound(m),
            Err(e) => Answer::Template(e.to_string()),
        };
        let half = base.saturating_add(init.memory_mib.saturating_mul(1 << 19));
        let retire = vm_size().is_none_or(|now| now > half);
        if write_frame(&mut output, &Reply { answer, retire }).is_err() {
            return ExitCode::from(2);
        }
        if retire {
            return ExitCode::SUCCESS;
        }
    }
}

/// The bounds a child renders within, beside the template's own.
#[derive(Clone, Debug)]
pub struct SandboxLimits {
    /// The executable that runs [`WORKER_ARG`] (`tl`).
    pub exe: PathBuf,
    /// Memory a render may take beyond the child's own at start.
    pub memory_mib: u64,
    /// How long one render may take.
    pub timeout: Duration,
}

/// A running child.
struct Worker {
    child: Arc<Mutex<Child>>,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    /// Kills and reaps the child.
    fn end(self) {
        let mut c = self
            .child
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Runs `io` (a blocking exchange with `child`) under a watchdog that kills the child when
/// `io` outlives `timeout`, which ends `io` too. Returns what `io` returned, and whether the
/// watchdog fired.
fn guarded<T>(
    child: &Arc<Mutex<Child>>,
    timeout: Duration,
    io: impl FnOnce() -> std::io::Result<T>,
) -> (std::io::Result<T>, bool) {
    let fired = Arc::new(AtomicBool::new(false));
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let (c, f) = (Arc::clone(child), Arc::clone(&fired));
    let watchdog = std::thread::Builder::new()
        .name("render-watchdog".into())
        .spawn(move || {
            if wait.recv_timeout(timeout) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                f.store(true, Ordering::SeqCst);
                if let Ok(mut c) = c.lock() {
                    let _ = c.kill();
                }
            }
        });
    let Ok(watchdog) = watchdog else {
        return (Err(std::io::Error::other("cannot start a watchdog")), false);
    };
    let r = io();
    drop(done);
    let _ = watchdog.join();
    (r, fired.load(Ordering::SeqCst))
}

/// The executable render processes start from: on Linux this process's own image
/// (`/proc/self/exe`, which keeps naming it after a rebuild or an upgrade renamed another file
/// over its path, or removed it), else the path it was started from.
#[must_use]
pub fn own_executable() -> Option<PathBuf> {
    let image = std::path::Path::new("/proc/self/exe");
    if cfg!(target_os = "linux") && image.exists() {
        return Some(image.to_path_buf());
    }
    std::env::current_exe().ok()
}

/// Children that render one template, kept between renders.
pub struct Sandbox {
    limits: SandboxLimits,
    init: Init,
    idle: Mutex<Vec<Worker>>,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Sandbox {
    /// Renders `template` in children started from `limits.exe`.
    #[must_use]
    pub fn new(template: &ChatTemplate, limits: SandboxLimits) -> Self {
        let b = template.bounds();
        Self {
            init: Init {
                source: template.source().to_owned(),
                bos: template.bos().map(str::to_owned),
                eos: template.eos().map(str::to_owned),
                fuel: b.fuel,
                max_bytes: b.max_bytes,
                memory_mib: limits.memory_mib,
            },
            limits,
            idle: Mutex::new(Vec::new()),
        }
    }

    fn spawn(&self) -> std::io::Result<Worker> {
        // An empty environment: the gateway's own (its API keys among it) is not the
        // template's to read.
        let mut child = Command::new(&self.limits.exe)
            .arg(WORKER_ARG)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other(
                "the render worker's pipes are missing",
            ));
        };
        let mut w = Worker {
            child: Arc::new(Mutex::new(child)),
            stdin,
            stdout: BufReader::new(stdout),
        };
        // A start (exec, the template parsed again) is not a render: it has its own deadline.
        let start = self.limits.timeout.max(Duration::from_secs(10));
        let (ready, _) = guarded(&w.child, start, || {
            write_frame(&mut w.stdin, &self.init)?;
            read_frame::<Answer>(&mut w.stdout)
        });
        match ready {
            Ok(Some(Answer::Text(_))) => Ok(w),
            other => {
                w.end();
                Err(std::io::Error::other(match other {
                    Ok(Some(Answer::Template(m) | Answer::Bound(m))) => m,
                    Err(e) => e.to_string(),
                    _ => "the render worker did not start in time".to_owned(),
                }))
            }
        }
    }

    /// Children waiting for a render.
    #[must_use]
    pub fn idle(&self) -> usize {
        self.idle.lock().map_or(0, |v| v.len())
    }

    /// `messages` through the template in a child, within the template's bounds and this
    /// sandbox's memory and time. Blocking: run it where blocking is allowed.
    ///
    /// # Errors
    /// The template's refusal, a bound ([`TextError::Bound`]: instructions, bytes, memory or
    /// time), or a child that could not be started.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let reused = self.idle.lock().ok().and_then(|mut v| v.pop());
        let mut w = match reused {
            Some(w) => w,
            None => self
                .spawn()
                .map_err(|e| TextError::Server(format!("cannot start a render worker: {e}")))?,
        };
        let ask = Ask {
            messages: messages.to_vec(),
            tools: tools.cloned(),
            add_generation_prompt,
        };
        let (answer, timed_out) = guarded(&w.child, self.limits.timeout, || {
            write_frame(&mut w.stdin, &ask)?;
            read_frame(&mut w.stdout)
        });
        match answer {
            Ok(Some(Reply { answer: a, retire })) if !timed_out => {
                if retire {
                    w.end();
                } else if let Ok(mut v) = self.idle.lock() {
                    v.push(w);
                }
                match a {
                    Answer::Text(s) => Ok(s),
                    Answer::Bound(m) => Err(TextError::Bound(m)),
                    Answer::Template(m) => Err(TextError::Template(m)),
                }
            }
            _ => {
                w.end();
                Err(TextError::Bound(if timed_out {
                    format!(
                        "ran past its time bound of {} ms",
                        self.limits.timeout.as_millis()
                    )
                } else {
                    format!(
                        "ran past its memory bound of {} MiB (its render process ended)",
                        self.limits.memory_mib
                    )
                }))
            }
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Ok(mut v) = self.idle.lock() {
            for w in v.drain(..) {
                // Closing stdin ends a child at its next read; kill in case it does not.
                w.end();
            }
        }
    }
}
