//! `tl probe URL`: one plain-HTTP request to a probe of the metrics listener (`/livez`,
//! `/readyz`, `POST /drain`), for container health checks and `preStop` hooks in images that
//! hold nothing but `tl`. Prints the body; exit 0 on 200, 1 otherwise, 2 for a malformed URL.

use std::process::ExitCode;
use std::time::Duration;

use tl_engine::net::clients::HttpClient;

use crate::run::block_on;

/// Arguments of `tl probe`.
#[derive(clap::Args, Debug)]
pub(crate) struct ProbeArgs {
    /// `http://host:port/path` (plain HTTP: the metrics listener).
    url: String,
    /// POST instead of GET (for `/drain`).
    #[arg(long)]
    post: bool,
    /// Give up after this many milliseconds.
    #[arg(long, default_value_t = 2_000)]
    timeout_ms: u64,
}

/// `(host:port, path)` of a plain `http://` URL.
fn split(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("http://")?;
    let slash = rest.find('/').unwrap_or(rest.len());
    let (addr, path) = rest.split_at(slash);
    (!addr.is_empty()).then_some((addr, if path.is_empty() { "/" } else { path }))
}

/// Runs `tl probe`.
#[must_use]
pub(crate) fn probe(args: &ProbeArgs) -> ExitCode {
    let Some((addr, path)) = split(&args.url) else {
        eprintln!("error: {:?} is not an http://host:port/path URL", args.url);
        return ExitCode::from(2);
    };
    block_on(async {
        let c = HttpClient::default();
        let call = async {
            if args.post {
                c.post(addr, path, &[], Vec::new()).await
            } else {
                c.get(addr, path).await
            }
        };
        match tokio::time::timeout(Duration::from_millis(args.timeout_ms), call).await {
            Ok(Ok(r)) => {
                print!("{}", String::from_utf8_lossy(&r.body));
                if r.status == 200 {
                    ExitCode::SUCCESS
                } else {
                    eprintln!("status {}", r.status);
                    ExitCode::from(1)
                }
            }
            Ok(Err(e)) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
            Err(_) => {
                eprintln!("error: no answer in {} ms", args.timeout_ms);
                ExitCode::from(1)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn urls() {
        assert_eq!(
            split("http://127.0.0.1:9/readyz"),
            Some(("127.0.0.1:9", "/readyz"))
        );
        assert_eq!(split("http://h:1"), Some(("h:1", "/")));
        assert_eq!(
            split("http://h:1/drain?deadline_ms=5"),
            Some(("h:1", "/drain?deadline_ms=5"))
        );
        assert_eq!(split("https://h:1/x"), None);
        assert_eq!(split("http:///x"), None);
    }
}
