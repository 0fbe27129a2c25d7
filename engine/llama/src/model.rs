//! The Llama forward pass over the pool: K (after RoPE) and V of every layer live in the
//! sequence's blocks as f16, in kv.wire.v1's layout, and attention reads them back from there,
//! for a prefill chunk as for a decode step. A chunk's rows write their K and V into the blocks
//! first and then attend over what they read back, so a prompt computed in one pass, continued
//! from cached blocks, or received over the wire sees the same f16 values, and a row's logits
//! are the same bits whatever else is in its batch.

use std::path::Path;

use kvwire::{Shape, f16};
use tl_engine_core::model::{Model, ModelError};
use tl_engine_core::pool::{BlockId, SharedKv};

use crate::config::{CheckpointError, LlamaConfig};
use crate::kernels::simd::Product;
use crate::kernels::{self, Kernels, matmul, rms_norm};
use crate::weights::{Tensor, Weights};

/// Prompt rows one prefill pass takes (rounded up to whole blocks).
const PREFILL_CHUNK_TOKENS: usize = 256;

struct Layer {
    attn_norm: Vec<f32>,
    mlp_norm: Vec<f32>,
    /// Gemma 3's: RMSNorm on each head of Q and of K, and after the attention and the MLP.
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    attn_post: Option<Vec<f32>>,
    mlp_post: Option<Vec<f32>>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

/// A Llama-family model loaded from a checkpoint directory.
pub struct Llama {
    name: String,
    cfg: LlamaConfig,
    shape: Shape,
    weights: Weights,
    embed: Tensor,
    lm_head: Tensor,
    final_norm: Vec<f32>,
    layers: Vec<Layer>,
    inv_freq: Vec<f64>,
    /// RoPE's frequencies on local (sliding-window) layers, where the model has any.
    local_inv_freq: Option<Vec<f64>>,
    /// What the embedding is multiplied by (Gemma: the square root of the width).
    embed_scale: Option<f32>,
    workers: std::sync::Arc<crate::workers::Workers>,
    kernels: Kernels,
    max_context: u32,
    /// What its token ids stand for, from its tokenizer (none: the byte vocabulary).
    vocab: Option<std::sync::Arc<tl_engine_core::vocab::Vocab>>,
    /// Its tokenizer, for text prompts (none: the byte tokenizer).
    text: Option<std::sync::Arc<crate::Text>>,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("name", &self.name)
            .field("config", &self.cfg)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

/// One position to run: its token, where it sits, the sequence's block table, whether its K and
/// V are to be written (else they are already in the blocks), and whether its logits are wanted.
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    /// The input token.
    pub token: u32,
    /// Its position.
    pub pos: usize,
    /// The sequence's blocks (they cover `pos`).
    pub blocks: &'a [BlockId],
    /// Write this position's K and V.
    pub write: bool,
    /// Return the logits after it.
    pub logits: bool,
}

/// One sequence's K and V of one layer, widened to f32 (positions x KV heads x head size), from
/// the position where they start on.
struct Widened {
    keys: Vec<f32>,
    vals: Vec<f32>,
    first: usize,
}

/// A forward pass's working rows: Q, K and V, the attention's output, a projection's output,
/// and the MLP's gate and up.
struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
}

impl Llama {
    /// Loads the checkpoint at `dir` (a directory's `config.json` and safetensors, or a GGUF
    /// file) with `block_tokens`
    /// tokens per KV block, computing on up to `threads` threads, serving at most
    /// `max_context` positions (the config's own limit when smaller). Every tensor's name,
    /// shape and dtype is checked here.
    ///
    /// # Errors
    /// [`CheckpointError`] naming the file, field or tensor.
    pub fn load(
        dir: &Path,
        name: &str,
        block_tokens: u32,
        threads: usize,
        max_context: u32,
    ) -> Result<Self, CheckpointError> {
        let (cfg, weights) = if crate::gguf::is_gguf(dir) {
            let g = crate::gguf::Gguf::open(dir)?;
            let cfg = g.config()?;
            let weights = g.weights(&cfg)?;
            (cfg, weights)
        } else {
            let cpath = dir.join("config.json");
            let text = std::fs::read_to_string(&cpath).map_err(|source| CheckpointError::Io {
                path: cpath.display().to_string(),
                source,
            })?;
            let cfg = LlamaConfig::parse(&cpath.display().to_string(), &text)?;
            (cfg, Weights::open(dir)?)
        };
        let (h, i, v) = (cfg.hidden, cfg.intermediate, cfg.vocab);
        let (qd, kvd) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        let embed = weights.tensor("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if cfg.tied {
            embed
        } else {
            weights.tensor("lm_head.weight", &[v, h])?
        };
        let final_norm = weights.vector("model.norm.weight", h)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        let gemma = cfg.gemma.is_some();
        let d = cfg.head_dim;
        for l in 0..cfg.layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let gemma_norm = |s: &str, n: usize| -> Result<Option<Vec<f32>>, CheckpointError> {
                if gemma {
                    weights.vector(&p(s), n).map(Some)
                } else {
                    Ok(None)
                }
            };
            let mlp_norm = if gemma {
                "pre_feedforward_layernorm.weight"
            } else {
                "post_attention_layernorm.weight"
            };
            let bias = |s: &str, n: usize| -> Result<Option<Vec<f32>>, CheckpointError> {
                if cfg.qkv_bias {
                    weights.vector(&p(s), n).map(Some)
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: weights.vector(&p("input_layernorm.weight"), h)?,
                mlp_norm: weights.vector(&p(mlp_norm), h)?,
                q_norm: gemma_norm("self_attn.q_norm.weight", d)?,
                k_norm: gemma_norm("self_attn.k_norm.weight", d)?,
                attn_post: gemma_norm("post_attention_layernorm.weight", h)?,
                mlp_post: gemma_norm("post_feedforward_layernorm.weight", h)?,
                q: weights.tensor(&p("self_attn.q_proj.weight"), &[qd, h])?,
                k: weights.tensor(&p("self_attn.k_proj.weight"), &[kvd, h])?,
                v: weights.tensor(&p("self_attn.v_proj.weight"), &[kvd, h])?,
                o: weights.tensor(&p("self_attn.o_proj.weight"), &[h, qd])?,
                q_bias: bias("self_attn.q_proj.bias", qd)?,
                k_bias: bias("self_attn.k_proj.bias", kvd)?,
                v_bias: bias("self_attn.v_proj.bias", kvd)?,
                gate: weights.tensor(&p("mlp.gate_proj.weight"), &[i, h])?,
                up: weights.tensor(&p("mlp.up_proj.weight"), &[i, h])?,
                down: weights.tensor(&p("mlp.down_proj.weight"), &[h, i])?,
            });
        }
        let shape = Shape::v1(
            block_tokens,
            cfg.layers as u32,
            cfg.kv_heads as u32,
            cfg.head_dim as u32,
        );
        if shape.payload_bytes().is_none() || block_tokens == 0 {
            return Err(CheckpointError::Unsupported {
                field: "num_hidden_layers",
                value: cfg.layers.to_string(),
                why: "the KV block of this model does not fit kv.wire.v1".into(),
            });
        }
        Ok(Self {
            name: name.to_owned(),
            inv_freq: cfg.inv_freq(),
            local_inv_freq: cfg.local_inv_freq(),
            embed_scale: gemma.then(|| (h as f32).sqrt()),
            max_context: max_context.min(u32::try_from(cfg.max_positions).unwrap_or(u32::MAX)),
            cfg,
            shape,
            weights,
            embed,
            lm_head,
            final_norm,
            layers,
            workers: std::sync::Arc::new(crate::workers::Workers::new(threads)),
            kernels: Kernels::default(),
            vocab: None,
            text: None,
        })
    }

    /// The same model on other matrix-multiply kernels (the default is [`Kernels::Simd`]).
    #[must_use]
    pub fn with_kernels(mut self, kernels: Kernels) -> Self {
        self.kernels = kernels;
        self
    }

    /// The same model with its checkpoint's text side: its tokenizer for text prompts, and its
    /// vocabulary for stop strings and text.
    #[must_use]
    pub fn with_text(mut self, text: std::sync::Arc<crate::Text>) -> Self {
        self.vocab = Some(std::sync::Arc::new(text.vocab()));
        self.text = Some(text);
        self
    }

    /// The kernels it runs.
    #[must_use]
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The validated configuration.
    #[must_use]
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Runs `rows` through every layer; returns the logits of the rows that want them, in
    /// order. A row's K and V are written into its block (when `write`) before any row attends,
    /// layer by layer, and its fills raised at the end.
    ///
    /// # Errors
    /// A token outside the vocabulary, or a block table that does not cover a position.
    pub fn forward(&self, pool: &SharedKv, rows: &[Row<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.workers.run(|| self.forward_here(pool, rows))
    }

    /// [`Self::forward`] on the calling thread.
    fn forward_here(&self, pool: &SharedKv, rows: &[Row<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.check_rows(rows)?;
        let (h, d) = (self.cfg.hidden, self.cfg.head_dim);
        let (nq, nkv) = (self.cfg.heads, self.cfg.kv_heads);
        let m = rows.len();
        // The residual stream, one row per position.
        let mut x = vec![0f32; m * h];
        let embed = self.weights.get(self.embed);
        for (i, r) in rows.iter().enumerate() {
            embed.row_into(r.token as usize, &mut x[i * h..(i + 1) * h]);
        }
        if let Some(scale) = self.embed_scale {
            for v in &mut x {
                *v *= scale;
            }
        }
        let global = self.rope_angles(rows, &self.inv_freq);
        let local = self
            .local_inv_freq
            .as_ref()
            .map(|f| self.rope_angles(rows, f));
        let i_dim = self.cfg.intermediate;
        let mut s = Scratch {
            q: vec![0f32; m * nq * d],
            k: vec![0f32; m * nkv * d],
            v: vec![0f32; m * nkv * d],
            att: vec![0f32; m * nq * d],
            o: vec![0f32; m * h],
            g: vec![0f32; m * i_dim],
            u: vec![0f32; m * i_dim],
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let window = self.cfg.window(l);
            let angles = match (&local, window) {
                (Some(local), Some(_)) => local,
                _ => &global,
            };
            self.attention(pool, l, layer, rows, &x, angles, &mut s)?;
            if let Some(w) = &layer.attn_post {
                rms_norm(&mut s.o, w, self.cfg.rms_eps);
            }
            for (a, b) in x.iter_mut().zip(&s.o) {
                *a += b;
            }
            self.mlp(layer, &x, &mut s);
            if let Some(w) = &layer.mlp_post {
                rms_norm(&mut s.o, w, self.cfg.rms_eps);
            }
            for (a, b) in x.iter_mut().zip(&s.o) {
                *a += b;
            }
        }
        self.raise_fills(pool, rows)?;
        Ok(self.logits(&x, rows))
    }

    /// Layer `l`'s attention over the residual stream `x` into `s.o`: the norm, Q, K and V
    /// (Gemma: each head normed), RoPE at `angles`, K and V written into the blocks of the rows
    /// that write, every head of every row attending over what its blocks hold (a local layer:
    /// over its window), and the output projection.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        pool: &SharedKv,
        l: usize,
        layer: &Layer,
        rows: &[Row<'_>],
        x: &[f32],
        angles: &(Vec<f32>, Vec<f32>),
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        let d = self.cfg.head_dim;
        let (nq, nkv) = (self.cfg.heads, self.cfg.kv_heads);
        let (kern, workers, w) = (self.kernels, &*self.workers, &self.weights);
        let mut hn = x.to_vec();
        rms_norm(&mut hn, &layer.attn_norm, self.cfg.rms_eps);
        kernels::matmul_many(
            kern,
            &hn,
            &mut [
                Product {
                    w: w.get(layer.q),
                    bias: layer.q_bias.as_deref(),
                    out: &mut s.q,
                },
                Product {
                    w: w.get(layer.k),
                    bias: layer.k_bias.as_deref(),
                    out: &mut s.k,
                },
                Product {
                    w: w.get(layer.v),
                    bias: layer.v_bias.as_deref(),
                    out: &mut s.v,
                },
            ],
            workers,
        );
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            rms_norm(&mut s.q, qn, self.cfg.rms_eps);
            rms_norm(&mut s.k, kn, self.cfg.rms_eps);
        }
        let half = d / 2;
        let (cos, sin) = angles;
        for i in 0..rows.len() {
            let (c, sn) = (
                &cos[i * half..(i + 1) * half],
                &sin[i * half..(i + 1) * half],
            );
            for head in s.q[i * nq * d..(i + 1) * nq * d].chunks_exact_mut(d) {
                kernels::rope(head, c, sn);
            }
            for head in s.k[i * nkv * d..(i + 1) * nkv * d].chunks_exact_mut(d) {
                kernels::rope(head, c, sn);
            }
        }
        for (i, r) in rows.iter().enumerate().filter(|(_, r)| r.write) {
            self.store(
                pool,
                l,
                r,
                &s.k[i * nkv * d..(i + 1) * nkv * d],
                &s.v[i * nkv * d..(i + 1) * nkv * d],
            )?;
        }
        let window = self.cfg.window(l);
        let (groups, owner) = self.gather_groups(pool, l, rows, window)?;
        // Each head of each row is computed whole by one thread, in the one order of
        // `attend`; the heads are split over the threads by how many positions they read.
        let parts = split_heads(&mut s.att, d, nq, rows, window, workers.threads());
        let q = &s.q;
        workers.each(parts, |(u0, dst)| {
            crate::kernels::simd::run(Heads {
                model: self,
                groups: &groups,
                owner: &owner,
                rows,
                window,
                q,
                first: u0,
                out: dst,
            });
        });
        matmul(kern, &s.att, w.get(layer.o), None, &mut s.o, workers);
        Ok(())
    }

    /// The MLP over the residual stream `x` into `s.o`: the norm, gate and up, SwiGLU (Gemma:
    /// GeGLU), and down.
    fn mlp(&self, layer: &Layer, x: &[f32], s: &mut Scratch) {
        let (kern, workers, w) = (self.kernels, &*self.workers, &self.weights);
        let mut hn = x.to_vec();
        rms_norm(&mut hn, &layer.mlp_norm, self.cfg.rms_eps);
        kernels::matmul_many(
            kern,
            &hn,
            &mut [
                Product {
                    w: w.get(layer.gate),
                    bias: None,
                    out: &mut s.g,
                },
                Product {
                    w: w.get(layer.up),
                    bias: None,
                    out: &mut s.u,
                },
            ],
            workers,
        );
        crate::kernels::simd::run(Glu {
            gate: &mut s.g,
            up: &s.u,
            gelu: self.cfg.gemma.is_some(),
        });
        matmul(kern, &s.g, w.get(layer.down), None, &mut s.o, workers);
    }

    /// Refuses a row whose token is outside the vocabulary or whose position has no block.
    fn check_rows(&self, rows: &[Row<'_>]) -> Result<(), ModelError> {
        let b = self.shape.block_tokens() as usize;
        for r in rows {
            if r.token as usize >= self.cfg.vocab {
                return Err(ModelError::BadToken(r.token));
            }
            if r.pos / b >= r.blocks.len() {
                return Err(ModelError::NoBlock {
                    pos: r.pos,
                    blocks: r.blocks.len(),
                });
            }
        }
        Ok(())
    }

    /// RoPE's angles per row (cosines, sines) at frequencies `inv_freq`, in f64, rounded once
    /// to f32.
    fn rope_angles(&self, rows: &[Row<'_>], inv_freq: &[f64]) -> (Vec<f32>, Vec<f32>) {
        let half = self.cfg.head_dim / 2;
        let mut cos = vec![0f32; rows.len() * half];
        let mut sin = vec![0f32; rows.len() * half];
        for (i, r) in rows.iter().enumerate() {
            for (j, f) in inv_freq.iter().enumerate() {
                let a = r.pos as f64 * f;
                cos[i * half + j] = a.cos() as f32;
                sin[i * half + j] = a.sin() as f32;
            }
        }
        (cos, sin)
    }

    /// Layer `l`'s K and V widened once per sequence (the rows of one block table share it),
    /// from the first position one of its rows reads (`window`: a local layer's), and each
    /// row's group.
    fn gather_groups(
        &self,
        pool: &SharedKv,
        l: usize,
        rows: &[Row<'_>],
        window: Option<usize>,
    ) -> Result<(Vec<Widened>, Vec<usize>), ModelError> {
        let m = rows.len();
        let mut groups = Vec::new();
        let mut owner = vec![0usize; m];
        let mut i = 0;
        while i < m {
            let table = rows[i].blocks;
            let mut j = i + 1;
            while j < m && std::ptr::eq(rows[j].blocks, table) {
                j += 1;
            }
            let n = rows[i..j].iter().map(|r| r.pos + 1).max().unwrap_or(0);
            let first = rows[i..j]
                .iter()
                .map(|r| first_read(r.pos, window))
                .min()
                .unwrap_or(0);
            owner[i..j].fill(groups.len());
            groups.push(self.gather(pool, l, table, first, n)?);
            i = j;
        }
        Ok((groups, owner))
    }

    /// The logits of the rows that want them, from the residual stream `x`.
    fn logits(&self, x: &[f32], rows: &[Row<'_>]) -> Vec<Vec<f32>> {
        let h = self.cfg.hidden;
        let wanted: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].logits).collect();
        let mut last = Vec::with_capacity(wanted.len() * h);
        for &i in &wanted {
            last.extend_from_slice(&x[i * h..(i + 1) * h]);
        }
        rms_norm(&mut last, &self.final_norm, self.cfg.rms_eps);
        let vocab = self.cfg.vocab;
        let mut logits = vec![0f32; wanted.len() * vocab];
        matmul(
            self.kernels,
            &last,
            self.weights.get(self.lm_head),
            None,
            &mut logits,
            &self.workers,
        );
        logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
    }

    /// Bytes of one row (one position, every KV head) of a plane, and of a plane.
    fn row_plane(&self) -> (usize, usize) {
        let row = self.cfg.kv_heads * self.cfg.head_dim * 2;
        (row, row * self.shape.block_tokens() as usize)
    }

    /// Writes one position's K and V of layer `l` into its block, as f16.
    fn store(
        &self,
        pool: &SharedKv,
        l: usize,
        r: &Row<'_>,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), ModelError> {
        let b = self.shape.block_tokens() as usize;
        let (row, plane) = self.row_plane();
        let id = r.blocks[r.pos / b];
        let slot = r.pos % b;
        let mut payload = pool.write(id)?;
        for (which, src) in [(0, k), (1, v)] {
            let at = (2 * l + which) * plane + slot * row;
            for (dst, x) in payload[at..at + row].chunks_exact_mut(2).zip(src) {
                dst.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
            }
        }
        Ok(())
    }

    /// K and V of layer `l` for positions `first..n` of the sequence with block table `blocks`,
    /// read from its blocks and widened to f32 (exactly: the f16 values the pool holds).
    fn gather(
        &self,
        pool: &SharedKv,
        l: usize,
        blocks: &[BlockId],
        first: usize,
        n: usize,
    ) -> Result<Widened, ModelError> {
        let b = self.shape.block_tokens() as usize;
        let (row, plane) = self.row_plane();
        let w = self.cfg.kv_heads * self.cfg.head_dim;
        let mut keys = vec![0f32; (n - first) * w];
        let mut vals = vec![0f32; (n - first) * w];
        let mut p = first;
        while p < n {
            // Slots `s0..s1` of block `bi`: a plane's rows are contiguous, so one widening per
            // plane of the block.
            let (bi, s0) = (p / b, p % b);
            let s1 = (n - bi * b).min(b);
            let payload = pool.read(blocks[bi])?;
            let (d0, d1) = ((p - first) * w, (bi * b + s1 - first) * w);
            let (kat, vat) = ((2 * l) * plane + s0 * row, (2 * l + 1) * plane + s0 * row);
            let len = (s1 - s0) * row;
            kernels::widen(
                &payload[kat..kat + len],
                kernels::DType::F16,
                &mut keys[d0..d1],
            );
            kernels::widen(
                &payload[vat..vat + len],
                kernels::DType::F16,
                &mut vals[d0..d1],
            );
            p = bi * b + s1;
        }
        Ok(Widened { keys, vals, first })
    }

    /// Attention of query head `hq` of one row over the first `n` positions of `keys` and
    /// `vals` (from [`Self::gather`], from the first position the row reads): against its KV
    /// head (GQA), softmax and weighted sum in position order.
    #[inline(always)]
    fn attend(&self, keys: &[f32], vals: &[f32], n: usize, hq: usize, qh: &[f32], oh: &mut [f32]) {
        let (d, nkv) = (self.cfg.head_dim, self.cfg.kv_heads);
        let group = self.cfg.heads / nkv;
        let scale = self.cfg.attn_scale();
        let mut scores = vec![0f32; n];
        let (keys, vals) = (&keys[..n * nkv * d], &vals[..n * nkv * d]);
        let kv = hq / group;
        let max = crate::kernels::simd::scores(qh, keys, nkv * d, kv * d, scale, &mut scores);
        // The exponentials first (a loop that vectorizes), then their sum in position order.
        for s in &mut scores {
            *s = kernels::exp(*s - max);
        }
        let mut sum = 0f32;
        for s in &scores {
            sum += *s;
        }
        oh.fill(0.0);
        for (p, s) in scores.iter().enumerate() {
            let w = s / sum;
            let vp = &vals[(p * nkv + kv) * d..(p * nkv + kv + 1) * d];
            for (o, x) in oh.iter_mut().zip(vp) {
                *o += w * x;
            }
        }
    }

    /// Raises the fills of the blocks the written rows filled.
    fn raise_fills(&self, pool: &SharedKv, rows: &[Row<'_>]) -> Result<(), ModelError> {
        let b = self.shape.block_tokens() as usize;
        let mut fills: Vec<(BlockId, u32)> = Vec::new();
        for r in rows.iter().filter(|r| r.write) {
            let id = r.blocks[r.pos / b];
            let fill = (r.pos % b + 1) as u32;
            match fills.iter_mut().find(|(i, _)| *i == id) {
                Some((_, f)) => *f = (*f).max(fill),
                None => fills.push((id, fill)),
            }
        }
        if fills.is_empty() {
            return Ok(());
        }
        let mut p = pool.lock();
        for (id, fill) in fills {
            let (_, old, _) = p.info(id)?;
            p.set_fill(id, old.max(fill))?;
        }
        Ok(())
    }
}

/// A run of heads' attention (head `first` on), as one vectorized job: a struct whose `call`
/// is inlined into the AVX2 context, where a closure's body might not be.
struct Heads<'a, 'r> {
    model: &'a Llama,
    groups: &'a [Widened],
    owner: &'a [usize],
    rows: &'a [Row<'r>],
    window: Option<usize>,
    q: &'a [f32],
    first: usize,
    out: &'a mut [f32],
}

impl pulp::NullaryFnOnce for Heads<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn call(self) {
        let (d, nq) = (self.model.cfg.head_dim, self.model.cfg.heads);
        let nkv = self.model.cfg.kv_heads;
        for (u, out) in (self.first..).zip(self.out.chunks_exact_mut(d)) {
            let (a, hq) = (u / nq, u % nq);
            let g = &self.groups[self.owner[a]];
            let pos = self.rows[a].pos;
            let from = (first_read(pos, self.window) - g.first) * nkv * d;
            self.model.attend(
                &g.keys[from..],
                &g.vals[from..],
                read(pos, self.window),
                hq,
                &self.q[(a * nq + hq) * d..(a * nq + hq + 1) * d],
                out,
            );
        }
    }
}

/// [`kernels::swiglu`] (or, `gelu`, [`kernels::geglu`]) as one vectorized job.
struct Glu<'a> {
    gate: &'a mut [f32],
    up: &'a [f32],
    gelu: bool,
}

impl pulp::NullaryFnOnce for Glu<'_> {
    type Output = ();

    #[inline(always)]
    fn call(self) {
        if self.gelu {
            kernels::geglu(self.gate, self.up);
        } else {
            kernels::swiglu(self.gate, self.up);
        }
    }
}

/// The first position a row at `pos` reads: 0, or on a local layer the start of its window.
fn first_read(pos: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// How many positions a row at `pos` reads.
fn read(pos: usize, window: Option<usize>) -> usize {
    pos + 1 - first_read(pos, window)
}

/// `att` (`nq` heads of `d` floats per row) cut into up to `threads` runs of whole heads, each
/// reading about as many cached positions as the others, with the index of each run's first
/// head (row times `nq` plus head).
fn split_heads<'a>(
    att: &'a mut [f32],
    d: usize,
    nq: usize,
    rows: &[Row<'_>],
    window: Option<usize>,
    threads: usize,
) -> Vec<(usize, &'a mut [f32])> {
    let units = rows.len() * nq;
    let cost = |u: usize| read(rows[u / nq].pos, window);
    let total: usize = (0..units).map(cost).sum();
    let share = total.div_ceil(threads.max(1)).max(1);
    let mut parts = Vec::with_capacity(threads);
    let mut rest = att;
    let (mut start, mut spent) = (0, 0);
    for u in 0..units {
        spent += cost(u);
        if spent >= share || u + 1 == units {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut((u + 1 - start) * d);
            parts.push((start, head));
            rest = tail;
            start = u + 1;
            spent = 0;
        }
    }
    parts
}

/// The row of a sequence's last token (its KV written when `write`), its logits wanted.
fn last_row<'a>(tokens: &[u32], blocks: &'a [BlockId], write: bool) -> Result<Row<'a>, ModelError> {
    let Some(&token) = tokens.last() else {
        return Err(ModelError::NoBlock {
            pos: 0,
            blocks: blocks.len(),
        });
    };
    Ok(Row {
        token,
        pos: tokens.len() - 1,
        blocks,
        write,
        logits: true,
    })
}

impl Model for Llama {
    fn name(&self) -> &str {
        &self.name
    }

    fn shape(&self) -> Shape {
        self.shape
    }

    fn vocab(&self) -> u32 {
        self.cfg.vocab as u32
    }

    fn prefill_chunk_blocks(&self) -> usize {
        // 256 prompt rows per pass: enough rows for the matmul kernels' blocking to pay for
        // widening and packing each weight, few enough that the first blocks stream early.
        PREFILL_CHUNK_TOKENS.div_ceil(self.shape.block_tokens() as usize)
    }

    fn max_context(&self) -> u32 {
        self.max_context
    }

    fn tokens(&self) -> std::sync::Arc<tl_engine_core::vocab::Vocab> {
        self.vocab
            .clone()
            .unwrap_or_else(tl_engine_core::vocab::Vocab::bytes)
    }

    fn identity(&self) -> Option<String> {
        Some(self.cfg.identity())
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, tl_engine_core::model::TokenizeError> {
        match &self.text {
            Some(t) => t
                .encode(text, true)
                .map_err(|e| tl_engine_core::model::TokenizeError(e.to_string())),
            None => Ok(tl_engine_core::model::encode_text(text)),
        }
    }

    fn write(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        first_pos: usize,
        blocks: &[BlockId],
    ) -> Result<(), ModelError> {
        let rows: Vec<Row<'_>> = tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| Row {
                token,
                pos: first_pos + i,
                blocks,
                write: true,
                logits: false,
            })
            .collect();
        self.forward(pool, &rows).map(|_| ())
    }

    fn logits(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        let row = last_row(tokens, blocks, false)?;
        Ok(self.forward(pool, &[row])?.swap_remove(0))
    }

    fn decode(
        &self,
        pool: &SharedKv,
        tokens: &[u32],
        blocks: &[BlockId],
    ) -> Result<Vec<f32>, ModelError> {
        let row = last_row(tokens, blocks, true)?;
        Ok(self.forward(pool, &[row])?.swap_remove(0))
    }

    fn decode_batch(
        &self,
        pool: &SharedKv,
        seqs: &[(&[u32], &[BlockId])],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let rows = seqs
            .iter()
            .map(|(tokens, blocks)| last_row(tokens, blocks, true))
            .collect::<Result<Vec<_>, _>>()?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.forward(pool, &rows)
    }
}
