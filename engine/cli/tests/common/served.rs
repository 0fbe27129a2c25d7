//! `tl serve` as a child process: started on SmolLM2 (fetched once) or another model, read up
//! to its listening line, killed when dropped.

use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

/// A running `tl serve`.
pub struct Served {
    pub child: Child,
    /// `host:port` of its OpenAI endpoint.
    pub addr: String,
    /// The model id it serves.
    pub model: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `exe serve --port 0 ARGS --model <SmolLM2>` with `envs`, once it listens.
pub fn serve(exe: &Path, args: &[&str], envs: &[(&str, &str)]) -> Served {
    serve_model(exe, &super::fetch::smollm2_gguf(), args, envs)
}

/// `exe serve --port 0 ARGS --model GGUF` with `envs`, once it listens.
pub fn serve_model(exe: &Path, gguf: &Path, args: &[&str], envs: &[(&str, &str)]) -> Served {
    let mut child = Command::new(exe)
        .args(["serve", "--port", "0"])
        .args(args)
        .arg("--model")
        .arg(gguf)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let listening: Value = loop {
        let line = lines
            .next()
            .expect("tl serve ended before it listened")
            .unwrap();
        if line.starts_with('{') {
            break serde_json::from_str(&line).unwrap();
        }
    };
    // The rest of its stdout is drained, so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let base = listening["base_url"].as_str().unwrap();
    Served {
        child,
        addr: base
            .trim_start_matches("http://")
            .trim_end_matches("/v1")
            .to_owned(),
        model: listening["model"].as_str().unwrap().to_owned(),
    }
}

/// A runtime of two workers for a test's clients of a [`Served`].
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
