//! `tl serve` against what happens to its own binary and its render processes (issue 63, class
//! 5 and a finding beside it): a binary renamed or replaced under a running server still
//! renders chats, the render processes do not inherit the server's environment (its API
//! keys among it), and SIGHUP stops the server as SIGTERM does, its certificate folder removed.

mod common;

use std::process::Command;

use common::served::Served;
use serde_json::json;
use tl_engine::net::clients::HttpClient;

const KEY: &str = "served-binary-tenant-key";

/// `exe serve` on SmolLM2 with a small pool, once it listens.
fn serve(exe: &std::path::Path) -> Served {
    common::served::serve(
        exe,
        &["--kv-cache-mib", "6", "--threads", "1"],
        &[("TL_API_KEYS", KEY)],
    )
}

/// `n` chats at once (so that new render processes start), each one's status and body.
fn chats(s: &Served, n: usize) -> Vec<(u16, String)> {
    let rt = common::served::runtime();
    rt.block_on(async {
        let client = HttpClient::default();
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let (client, addr, model) = (client.clone(), s.addr.clone(), s.model.clone());
                tokio::spawn(async move {
                    let body = json!({
                        "model": model, "max_tokens": 2, "temperature": 0,
                        "messages": [{"role": "user", "content": format!("Say {i}.")}],
                    });
                    let r = client
                        .post(
                            &addr,
                            "/v1/chat/completions",
                            &[("authorization", &format!("Bearer {KEY}"))],
                            body.to_string(),
                        )
                        .await
                        .unwrap();
                    (r.status, String::from_utf8_lossy(&r.body).into_owned())
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
}

/// The pids whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // The fields after the command's closing parenthesis: state, then the parent's pid.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        if rest.split_whitespace().nth(1) == Some(&pid.to_string()) {
            out.push(p);
        }
    }
    out
}

/// A rebuild or an upgrade renames a new binary over the old path while the server runs: the
/// server still starts render processes (from its own image, not the path), every chat is
/// answered 200, and none is blamed on its `messages`.
#[test]
fn a_binary_replaced_under_a_running_server_still_renders_chats() {
    let dir = std::env::temp_dir().join(format!("tl-served-binary-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("tl");
    std::fs::copy(env!("CARGO_BIN_EXE_tl"), &exe).unwrap();
    let s = serve(&exe);
    // What `cargo build` or a package upgrade does: a new file renamed over the old path.
    let next = dir.join("tl.new");
    std::fs::write(&next, "#!/bin/sh\nexit 3\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&next, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::rename(&next, &exe).unwrap();
    for (status, body) in chats(&s, 6) {
        assert_eq!(status, 200, "{body}");
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The render processes start with an empty environment: the server's API keys (and anything
/// else in its environment) are not there for a template to find.
#[test]
fn render_processes_do_not_inherit_the_servers_environment() {
    let s = serve(std::path::Path::new(env!("CARGO_BIN_EXE_tl")));
    for (status, body) in chats(&s, 2) {
        assert_eq!(status, 200, "{body}");
    }
    let workers: Vec<u32> = children(s.child.id())
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("__render-worker"))
        })
        .collect();
    assert!(
        !workers.is_empty(),
        "no render process is kept after a chat"
    );
    for p in workers {
        let env = std::fs::read(format!("/proc/{p}/environ")).unwrap();
        let env = String::from_utf8_lossy(&env);
        assert!(!env.contains(KEY), "render process {p} holds the API keys");
        assert!(!env.contains("TL_API_KEYS"), "render process {p}: {env}");
    }
}

/// SIGHUP (the terminal closed) drains and stops `tl serve` as SIGTERM does: exit status 0, and
/// the run's certificate folder (its CA key inside) is gone from the temp dir.
#[test]
fn sighup_stops_the_server_and_removes_its_certificates() {
    let mut s = serve(std::path::Path::new(env!("CARGO_BIN_EXE_tl")));
    let pid = s.child.id();
    let ours = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("tl-serve-{pid}-")))
            })
            .collect()
    };
    assert_eq!(
        ours().len(),
        1,
        "a running server keeps one certificate folder"
    );
    let hup = Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "tl serve ignored SIGHUP"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(ours().is_empty(), "left behind: {:?}", ours());
}

/// Issue 63 (a finding): a keyed `tl serve` sets per-key quotas by flag. With
/// `--max-inflight-per-key 1`, a key's second request while its first streams gets 429 with
/// `Retry-After`; and `--allowed-host` opens the DNS-rebinding check for a name the operator
/// uses, which is refused without it.
#[test]
fn serve_sets_per_key_quotas_and_allowed_hosts_by_flag() {
    let s = common::served::serve(
        std::path::Path::new(env!("CARGO_BIN_EXE_tl")),
        &[
            "--kv-cache-mib",
            "6",
            "--max-inflight-per-key",
            "1",
            "--allowed-host",
            "tl.internal",
        ],
        &[("TL_API_KEYS", KEY)],
    );
    let rt = common::served::runtime();
    rt.block_on(async {
        let client = HttpClient::default();
        let auth = format!("Bearer {KEY}");
        let body = |n: u32| {
            json!({
                "model": s.model, "max_tokens": n, "ignore_eos": true, "temperature": 0,
                "messages": [{"role": "user", "content": "Count to ten."}],
            })
            .to_string()
        };
        // The key's first request, streamed: in flight once its first event arrived.
        let mut long = {
            let b = json!({
                "model": s.model, "max_tokens": 120, "ignore_eos": true, "temperature": 0,
                "stream": true,
                "messages": [{"role": "user", "content": "Count to ten."}],
            })
            .to_string();
            let (status, body) = client
                .post_streaming(
                    &s.addr,
                    "/v1/chat/completions",
                    &[("authorization", &auth)],
                    b,
                )
                .await
                .unwrap();
            assert_eq!(status, 200);
            tl_engine::net::clients::EventStream::new(body)
        };
        assert!(
            long.next().await.is_some_and(|e| e.is_ok()),
            "no first event"
        );
        // Its second while the first streams: 429 with Retry-After.
        let r = client
            .post(
                &s.addr,
                "/v1/chat/completions",
                &[("authorization", &auth)],
                body(1),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
        assert!(r.headers.get("retry-after").is_some());
        while let Some(e) = long.next().await {
            e.unwrap();
        }
        // The operator's name is served from loopback; another is not.
        for (host, want) in [("tl.internal", 200), ("attacker.example", 403)] {
            let r = client
                .post(
                    &s.addr,
                    "/v1/chat/completions",
                    &[("authorization", &auth), ("host", host)],
                    body(1),
                )
                .await
                .unwrap();
            assert_eq!(
                r.status,
                want,
                "{host}: {}",
                String::from_utf8_lossy(&r.body)
            );
        }
    });
}
