//! The real transformer: checked against the independent Python reference, batch-invariant bit
//! for bit, disaggregated equal to colocated, and refusing malformed checkpoints by name.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvwire::Shape;
use tl_engine_core::engine::{Choices, Engine, Mode, PrefillOutput, Request, Resume, StepEvent};
use tl_engine_core::model::Model;
use tl_engine_core::pool::{BlockKey, Blocks, KvPool, SharedKv};
use tl_engine_core::sampler::{Sampling, SamplingRequest};
use tl_llama::LlamaConfig;
use tl_llama::init::write_checkpoint;
use tl_llama::kernels::DType;
use tl_llama::model::Row;
use tl_llama::{CheckpointError, Llama};

const B: u32 = 4;
const VOCAB: usize = 260;

/// A checkpoint directory, removed at the end.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "tl-llama-{name}-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        ));
        Self(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tiny(name: &str, shape: &LlamaConfig, dtype: DType, shards: usize) -> Dir {
    let d = Dir::new(name);
    write_checkpoint(&d.0, shape, dtype, 7, shards, 257, 256).unwrap();
    d
}

fn load(dir: &Path) -> Arc<Llama> {
    Arc::new(Llama::load(dir, "tiny", B, 2, 1024).unwrap())
}

fn pool_for(m: &Llama, blocks: usize) -> SharedKv {
    SharedKv::new(KvPool::new(m.shape(), blocks))
}

/// Every position's logits of `prompt`, in one pass, over fresh blocks.
fn all_logits(m: &Llama, prompt: &[u32]) -> Vec<Vec<f32>> {
    let pool = pool_for(m, 64);
    let n = prompt.len().div_ceil(B as usize);
    let ids = pool.lock().allocate(n).unwrap();
    let rows: Vec<Row<'_>> = prompt
        .iter()
        .enumerate()
        .map(|(pos, &token)| Row {
            token,
            pos,
            blocks: &ids,
            write: true,
            logits: true,
        })
        .collect();
    let out = m.forward(&pool, &rows).unwrap();
    let mut p = pool.lock();
    for id in ids {
        p.release(id).unwrap();
    }
    out
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![256, 72, 101, 108, 108, 111],
        vec![256, 1, 2, 3, 4, 5, 6, 7, 8, 9],
        (0..13).map(|i| (i * 17 + 3) % 256).collect(),
        vec![256],
        vec![256, 200, 201, 202, 203, 204, 205, 206],
    ]
}

fn request(prompt: &[u32], sampling: Sampling, seed: u64, max_tokens: u32, mode: Mode) -> Request {
    Request {
        prompt: prompt.to_vec(),
        sampling,
        seed,
        max_tokens,
        mode,
        draws_offset: 0,
        stop: Default::default(),
        choices: Choices {
            n: 1,
            logprobs: Some(3),
        },
        scope: 0,
        earlier_output: 0,
        constraint: None,
    }
}

fn seeded() -> Sampling {
    Sampling::new(
        SamplingRequest {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 0,
            ..SamplingRequest::default()
        },
        VOCAB as u32,
    )
    .unwrap()
}

/// Runs the Python reference on `dir`.
fn reference(dir: &Path, prompts: &[Vec<u32>], steps: usize) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../parity/llama_ref.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(dir)
        .arg("--prompts")
        .arg(serde_json::to_string(prompts).unwrap())
        .arg("--steps")
        .arg(steps.to_string())
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "the reference failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `max |a - b| / max |b|` over one position's logits.
fn rel_err(a: &[f32], b: &[serde_json::Value]) -> f64 {
    let b: Vec<f64> = b.iter().map(|v| v.as_f64().unwrap()).collect();
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = a
        .iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((f64::from(*x) - y).abs()));
    err / scale
}

#[test]
fn llama_logits_match_the_reference() {
    let mut qwen = LlamaConfig::tiny(VOCAB);
    qwen.qkv_bias = true;
    qwen.tied = true;
    qwen.rope = tl_llama::config::Rope::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64.0,
    };
    qwen.rope_theta = 500_000.0;
    let cases = [
        ("llama-bf16", LlamaConfig::tiny(VOCAB), DType::Bf16),
        ("qwen2-f16-llama3-rope", qwen, DType::F16),
    ];
    for (name, shape, dtype) in cases {
        let dir = tiny(name, &shape, dtype, 1);
        let m = load(&dir.0);
        let want = reference(&dir.0, &prompts(), 32);
        let mut worst = 0f64;
        for (i, p) in prompts().iter().enumerate() {
            let got = all_logits(&m, p);
            let positions = want[i]["logits"].as_array().unwrap();
            assert_eq!(got.len(), positions.len());
            for (pos, (g, w)) in got.iter().zip(positions).enumerate() {
                let e = rel_err(g, w.as_array().unwrap());
                worst = worst.max(e);
                assert!(
                    e <= 1e-4,
                    "{name}: prompt {i} position {pos}: relative error {e:e}"
                );
            }
            // Greedy, 32 steps, through the engine.
            let mut e = Engine::new(m.clone(), pool_for(&m, 64));
            let tokens = e
                .generate(request(p, Sampling::greedy(), 0, 32, Mode::Generate))
                .unwrap();
            let greedy: Vec<u32> = want[i]["greedy"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(tokens, greedy, "{name}: prompt {i}");
        }
        eprintln!("{name}: worst relative error {worst:e}");
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn real_model_is_batch_invariant() {
    let dir = tiny("invariant", &LlamaConfig::tiny(VOCAB), DType::Bf16, 1);
    let m = load(&dir.0);
    let prompt: Vec<u32> = (0..21).map(|i| (i * 29 + 5) % 256).collect();
    let alone = all_logits(&m, &prompt);
    let last = alone.last().unwrap().clone();

    // Chunked at three sizes: the prompt's logits after each chunking are the same bits.
    for chunk in [1usize, 3, 7] {
        let pool = pool_for(&m, 16);
        let ids = pool
            .lock()
            .allocate(prompt.len().div_ceil(B as usize))
            .unwrap();
        for from in (0..prompt.len()).step_by(chunk) {
            let to = (from + chunk).min(prompt.len());
            m.write(&pool, &prompt[from..to], from, &ids).unwrap();
        }
        assert_eq!(
            bits(&m.logits(&pool, &prompt, &ids).unwrap()),
            bits(&last),
            "chunk {chunk}"
        );
    }

    // In a batch of 7 others: every row of one forward pass is its own alone.
    let pool = pool_for(&m, 128);
    let others: Vec<Vec<u32>> = (1..8)
        .map(|s| {
            (0..(5 + s * 3))
                .map(|i| ((i * 13 + s * 41) % 256) as u32)
                .collect()
        })
        .collect();
    let mut all = others.clone();
    all.insert(3, prompt.clone());
    let tables: Vec<Vec<u32>> = all
        .iter()
        .map(|p| pool.lock().allocate(p.len().div_ceil(B as usize)).unwrap())
        .collect();
    let mut rows = Vec::new();
    for (p, ids) in all.iter().zip(&tables) {
        for (pos, &token) in p.iter().enumerate() {
            rows.push(Row {
                token,
                pos,
                blocks: ids,
                write: true,
                logits: true,
            });
        }
    }
    let batch = m.forward(&pool, &rows).unwrap();
    let mut at = 0;
    for (i, p) in all.iter().enumerate() {
        let want = if i == 3 {
            alone.clone()
        } else {
            all_logits(&m, p)
        };
        for (pos, w) in want.iter().enumerate() {
            assert_eq!(
                bits(&batch[at + pos]),
                bits(w),
                "sequence {i} position {pos}"
            );
        }
        at += p.len();
    }

    // From a cached prefix, and decoded beside other sequences: the same tokens and
    // log-probabilities as alone.
    let alone_run = Engine::new(m.clone(), pool_for(&m, 64))
        .generate_choices(request(&prompt, seeded(), 9, 12, Mode::Generate))
        .unwrap();
    let mut e = Engine::new(m.clone(), pool_for(&m, 256));
    e.generate(request(
        &prompt[..16],
        Sampling::greedy(),
        0,
        2,
        Mode::Generate,
    ))
    .unwrap();
    for (s, p) in others.iter().enumerate() {
        e.submit(request(p, seeded(), s as u64, 20, Mode::Generate))
            .unwrap();
    }
    let id = e
        .submit(request(&prompt, seeded(), 9, 12, Mode::Generate))
        .unwrap();
    let mut got = tl_engine_core::engine::Generated::default();
    while !e.is_idle() {
        for ev in e.step().0 {
            match ev {
                StepEvent::Token {
                    seq,
                    token,
                    logprobs,
                    ..
                } if seq == id => {
                    got.tokens.push(token);
                    got.logprobs.extend(logprobs);
                }
                StepEvent::Finished { seq, reason, .. } if seq == id => got.finish = Some(reason),
                StepEvent::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
    }
    assert_eq!(got, alone_run[0], "beside 7 others, from a cached prefix");

    // Through P/D: prefilled in one pool, its blocks imported into another, resumed there.
    let p_engine = Engine::new(m.clone(), pool_for(&m, 64));
    let d_engine = Engine::new(m.clone(), pool_for(&m, 64));
    let tokens = disaggregated(p_engine, d_engine, &prompt, seeded(), 9, 12);
    assert_eq!(tokens, alone_run[0].tokens, "prefilled here, decoded there");
}

fn disaggregated(
    mut p: Engine,
    mut d: Engine,
    prompt: &[u32],
    s: Sampling,
    seed: u64,
    max_tokens: u32,
) -> Vec<u32> {
    let sid = p
        .submit(Request {
            choices: Choices::ONE,
            ..request(prompt, s.clone(), seed, 1, Mode::PrefillOnly)
        })
        .unwrap();
    let mut out: Option<PrefillOutput> = None;
    for ev in p.step().0 {
        if let StepEvent::Prefilled { seq, output } = ev
            && seq == sid
        {
            out = Some(output);
        }
    }
    let out = out.expect("prefilled");
    let mut imported = Vec::new();
    {
        let src = p.pool().lock();
        let mut dst = d.pool().lock();
        let b = B as usize;
        for (i, &bid) in out.blocks.ids().iter().enumerate() {
            let (bytes, fill) = src.export(bid).unwrap();
            let key = BlockKey {
                scope: 0,
                hash: out.hashes.get(i).copied().unwrap_or(0),
                tokens: &out.prompt[i * b..i * b + fill as usize],
                parent: imported.last().copied(),
            };
            imported.push(dst.import(key, fill, &bytes).unwrap());
        }
    }
    let blocks = Blocks::new(d.pool().clone(), imported);
    let id = d
        .resume(Resume {
            scope: 0,
            prompt: prompt.to_vec(),
            blocks,
            first_token: out.first_token,
            draws: u64::from(out.draws),
            sampling: s,
            seed,
            max_tokens,
            stop: Default::default(),
            choices: Choices::ONE,
            earlier_output: 0,
            constraint: None,
        })
        .unwrap();
    let rest = d.run_to_end(id).unwrap();
    [&[out.first_token][..], &rest].concat()
}

#[test]
fn a_sharded_checkpoint_loads_as_one() {
    let one = tiny("one", &LlamaConfig::tiny(VOCAB), DType::Bf16, 1);
    let three = tiny("three", &LlamaConfig::tiny(VOCAB), DType::Bf16, 3);
    assert!(three.0.join("model.safetensors.index.json").exists());
    assert!(three.0.join("model-00003-of-00003.safetensors").exists());
    let p = &prompts()[1];
    assert_eq!(
        all_logits(&load(&one.0), p)
            .iter()
            .map(|l| bits(l))
            .collect::<Vec<_>>(),
        all_logits(&load(&three.0), p)
            .iter()
            .map(|l| bits(l))
            .collect::<Vec<_>>()
    );
    let m = load(&three.0);
    assert_eq!(m.shape(), Shape::v1(B, 2, 2, 16));
}

#[test]
fn malformed_checkpoints_are_refused_by_name() {
    let shape = LlamaConfig::tiny(VOCAB);
    let err = |dir: &Dir| {
        Llama::load(&dir.0, "x", B, 1, 1024)
            .unwrap_err()
            .to_string()
    };

    let d = tiny("arch", &shape, DType::F32, 1);
    let cfg = std::fs::read_to_string(d.0.join("config.json")).unwrap();
    std::fs::write(
        d.0.join("config.json"),
        cfg.replace("LlamaForCausalLM", "GPTNeoXForCausalLM"),
    )
    .unwrap();
    let e = err(&d);
    assert!(
        e.contains("architectures") && e.contains("GPTNeoXForCausalLM"),
        "{e}"
    );

    // A missing tensor: written without the last layer's down projection.
    let d = Dir::new("missing");
    let mut fewer = shape.clone();
    fewer.layers = 3;
    write_checkpoint(&d.0, &fewer, DType::F32, 1, 1, 257, 256).unwrap();
    let cfg = std::fs::read_to_string(d.0.join("config.json")).unwrap();
    std::fs::write(
        d.0.join("config.json"),
        cfg.replace("\"num_hidden_layers\": 3", "\"num_hidden_layers\": 4"),
    )
    .unwrap();
    let e = err(&d);
    assert_eq!(e, "missing tensor model.layers.3.input_layernorm.weight");

    // A shape that does not match the config.
    let d = tiny("shape", &shape, DType::F32, 1);
    let cfg = std::fs::read_to_string(d.0.join("config.json")).unwrap();
    std::fs::write(
        d.0.join("config.json"),
        cfg.replace("\"intermediate_size\": 160", "\"intermediate_size\": 128"),
    )
    .unwrap();
    let e = err(&d);
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("[160, 64]"),
        "{e}"
    );

    // A dtype the kernels do not read.
    let d = Dir::new("dtype");
    std::fs::create_dir_all(&d.0).unwrap();
    std::fs::write(d.0.join("config.json"), shape.config_json(257, 256)).unwrap();
    let bytes = vec![0u8; VOCAB * 64];
    let view = safetensors_view(&bytes);
    std::fs::write(d.0.join("model.safetensors"), view).unwrap();
    let e = err(&d);
    assert!(
        e.contains("model.embed_tokens.weight") && e.contains("I8"),
        "{e}"
    );

    // A truncated file.
    let d = tiny("cut", &shape, DType::F32, 1);
    let f = d.0.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    let data = std::fs::read(&f).unwrap();
    std::fs::write(&f, &data[..(len / 2) as usize]).unwrap();
    let e = err(&d);
    assert!(e.contains("model.safetensors"), "{e}");

    // No config at all.
    let d = Dir::new("empty");
    std::fs::create_dir_all(&d.0).unwrap();
    assert!(matches!(
        Llama::load(&d.0, "x", B, 1, 1024),
        Err(CheckpointError::Io { .. })
    ));
}

/// A safetensors file whose embedding is I8.
fn safetensors_view(bytes: &[u8]) -> Vec<u8> {
    let header = serde_json::json!({
        "model.embed_tokens.weight": {"dtype": "I8", "shape": [VOCAB, 64], "data_offsets": [0, bytes.len()]}
    })
    .to_string();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(bytes);
    out
}

/// On the real model too, preemption and `n > 1` keep exactness: three requests (one of two
/// choices) in a pool too small for all of them finish with the tokens and log-probabilities
/// each has alone.
#[test]
fn preemption_and_choices_stay_exact_on_the_real_model() {
    let dir = tiny("preempt", &LlamaConfig::tiny(VOCAB), DType::Bf16, 1);
    let m = load(&dir.0);
    let reqs: Vec<Request> = (0..3u64)
        .map(|i| {
            let prompt: Vec<u32> = (0..(9 + i as u32 * 4))
                .map(|t| (t * 11 + 3) % 256)
                .collect();
            Request {
                choices: Choices {
                    n: if i == 1 { 2 } else { 1 },
                    logprobs: Some(2),
                },
                ..request(&prompt, seeded(), 40 + i, 30, Mode::Generate)
            }
        })
        .collect();
    let alone: Vec<_> = reqs
        .iter()
        .map(|r| {
            Engine::new(m.clone(), pool_for(&m, 128))
                .generate_choices(r.clone())
                .unwrap()
        })
        .collect();
    // About 40 blocks wanted in all, 20 in the pool.
    let mut e = Engine::new(m.clone(), pool_for(&m, 20));
    let ids: Vec<u64> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    let mut got: std::collections::HashMap<(u64, u32), tl_engine_core::engine::Generated> =
        std::collections::HashMap::new();
    while !e.is_idle() {
        for ev in e.step().0 {
            match ev {
                StepEvent::Token {
                    seq,
                    choice,
                    token,
                    logprobs,
                    ..
                } => {
                    let g = got.entry((seq, choice)).or_default();
                    g.tokens.push(token);
                    g.logprobs.extend(logprobs);
                }
                StepEvent::Finished {
                    seq,
                    choice,
                    reason,
                } => got.entry((seq, choice)).or_default().finish = Some(reason),
                StepEvent::Failed { error, .. } => panic!("{error}"),
                StepEvent::Prefilled { .. } => {}
            }
        }
    }
    assert!(
        e.preemptions() >= 1,
        "the pool was meant to force preemption"
    );
    for (i, id) in ids.iter().enumerate() {
        for (c, want) in alone[i].iter().enumerate() {
            assert_eq!(&got[&(*id, c as u32)], want, "request {i} choice {c}");
        }
    }
    let c = e.pool().lock().counts();
    assert_eq!(c.used, 0, "{c:?}");
}

/// A checkpoint truncated (or rewritten) while its model is served changes nothing: the weights
/// were read into the process's own memory at load, so the next forward pass gives the same
/// bits, where a mapped file would have faulted (SIGBUS) on a page it no longer has.
#[test]
fn a_checkpoint_truncated_while_served_changes_nothing() {
    let dir = tiny("truncated", &LlamaConfig::tiny(VOCAB), DType::Bf16, 1);
    let m = load(&dir.0);
    let prompt = [1u32, 2, 3, 4, 5, 6];
    let before = all_logits(&m, &prompt);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.0.join("model.safetensors"))
        .unwrap();
    file.set_len(64).unwrap();
    drop(file);
    let after = all_logits(&m, &prompt);
    assert_eq!(
        before.iter().map(|r| bits(r)).collect::<Vec<_>>(),
        after.iter().map(|r| bits(r)).collect::<Vec<_>>()
    );
    // Loading it again now is a clean refusal naming the file.
    let e = Llama::load(&dir.0, "t", B, 1, 64).unwrap_err().to_string();
    assert!(e.contains("model.safetensors"), "{e}");
}
