//! The Llama decoder (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation
//! Language Models"), as transformers' `LlamaForCausalLM` runs it, arranged for a
//! server that batches variable-length sequences: every linear layer and norm runs on
//! the new tokens of all sequences at once (rows concatenated along dim 0), attention
//! runs per sequence against that sequence's own [`KvCache`].
//!
//! Reads `LlamaConfig` (`text_config`): `vocab_size`, `hidden_size`,
//! `intermediate_size`, `num_hidden_layers`, `num_attention_heads`,
//! `num_key_value_heads` (GQA), `head_dim`, `rms_norm_eps`, `rope_theta`, `rope_type`
//! (only `default`), `hidden_act`, `attention_bias` (q, k, v), `o_proj_bias`, `mlp_bias`;
//! with Qwen2's biases it is `Qwen2ForCausalLM`. The LM head falls back
//! to the embedding matrix (tied embeddings) when the checkpoint has no `lm_head.weight`.
//!
//! RoPE is the "rotate_half" (GPT-NeoX) form, with the angles computed in f32 as
//! transformers computes them.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::RmsNorm;

use crate::linear::Linear;
use mmserve_config::{LlamaConfig, ModelDir};
use mmserve_ops::decoder_fused::{ADD_RMSNORM_MAX_WIDTH, PoolSlots, add_rmsnorm, rope_split, rope_split_into};
use mmserve_ops::fused::scaled_softmax;

use crate::ModelError;
use crate::activation::Activation;
use crate::load::Placement;
use crate::weights::{Scope, Weights};

/// One sequence's keys and values: per layer [kv_heads, len, head_dim].
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// Tokens cached (the position the next token takes).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keys and values of `layer` after appending `k`, `v` [kv_heads, n, head_dim].
    /// `len` moves only when the whole forward step succeeded.
    fn append(&mut self, layer: usize, k: Tensor, v: Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let kv = match &self.layers[layer] {
            None => (k, v),
            Some((k0, v0)) => (Tensor::cat(&[k0, &k], 1)?, Tensor::cat(&[v0, &v], 1)?),
        };
        self.layers[layer] = Some(kv.clone());
        Ok(kv)
    }

    /// Drops whatever a failed step appended past `len`.
    fn rollback(&mut self) {
        let len = self.len;
        for entry in &mut self.layers {
            *entry = match entry.take() {
                Some((k, v)) if len > 0 => k.narrow(1, 0, len).ok().zip(v.narrow(1, 0, len).ok()),
                _ => None,
            };
        }
    }
}

/// Every layer's K and V pools ([blocks, kv_heads, block_size, head_dim] each) and the
/// step's new rows' slots in them (u32 [T]), for projections that write k and v there.
#[derive(Clone, Copy)]
pub(crate) struct LayerPools<'a> {
    pub k: &'a [Tensor],
    pub v: &'a [Tensor],
    pub slots: &'a Tensor,
}

/// One sequence of a batched forward step.
pub struct SeqInput<'a> {
    /// Rows of the step's `input_embeds` that belong to this sequence (in order).
    pub new_tokens: usize,
    /// The sequence's cache; the new tokens take positions `cache.len()..`.
    pub cache: &'a mut KvCache,
}

/// The q, k and v projections.
enum QkvProj {
    /// The checkpoint's three (the CPU: candle's ops, whose results parity pins down).
    Separate { q: Linear, k: Linear, v: Linear },
    /// Their weights stacked into one GEMM, split (and rotated) by `rope_split` (the GPU).
    Fused(Linear),
}

pub(crate) struct Attention {
    qkv: QkvProj,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn load(s: &Scope, cfg: &LlamaConfig) -> Result<Self, ModelError> {
        let (h, d, bias) = (cfg.hidden_size, cfg.head_dim, cfg.attention_bias);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let (q, k, v) = (
            s.linear("q_proj", h, nh * d, bias)?,
            s.linear("k_proj", h, nkv * d, bias)?,
            s.linear("v_proj", h, nkv * d, bias)?,
        );
        let qkv = if s.device().is_cuda() {
            QkvProj::Fused(Linear::stack(&[q, k, v])?)
        } else {
            QkvProj::Separate { q, k, v }
        };
        Ok(Attention {
            qkv,
            o_proj: s.linear("o_proj", nh * d, h, cfg.o_proj_bias)?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        })
    }

    /// Queries, keys and values of the rows `x` [T, hidden], RoPE applied with
    /// `cos`/`sin` [T, head_dim / 2]: q [T, heads, head_dim], k and v [T, kv_heads, head_dim].
    /// Given `pools` of the projection's dtype, the fused projection writes k and v into
    /// their slots itself and returns none.
    pub(crate) fn project(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        pools: Option<PoolSlots<'_>>,
    ) -> candle_core::Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let t = x.dim(0)?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q, k, v) = match &self.qkv {
            QkvProj::Fused(qkv) => {
                let qkv = qkv.forward(x)?;
                return match pools.filter(|p| p.k.dtype() == qkv.dtype()) {
                    Some(p) => Ok((rope_split_into(&qkv, cos, sin, (nh, nkv, hd), p)?, None)),
                    None => rope_split(&qkv, cos, sin, (nh, nkv, hd)).map(|(q, k, v)| (q, Some((k, v)))),
                };
            }
            QkvProj::Separate { q, k, v } => (q, k, v),
        };
        let q = q.forward(x)?.reshape((1, t, nh, hd))?;
        let k = k.forward(x)?.reshape((1, t, nkv, hd))?;
        let v = v.forward(x)?.reshape((t, nkv, hd))?;
        let q = candle_nn::rotary_emb::rope_thd(&q, cos, sin)?.squeeze(0)?;
        let k = candle_nn::rotary_emb::rope_thd(&k, cos, sin)?.squeeze(0)?;
        Ok((q, Some((k, v))))
    }

    /// The softmax scale, `head_dim^-½`.
    pub(crate) fn scale(&self) -> f32 {
        (self.head_dim as f32).powf(-0.5)
    }

    /// Causal attention of one sequence's `n` new queries `q` [n, heads, head_dim] (at
    /// positions `past..past + n`) over its keys and values `k`, `v`
    /// [kv_heads, past + n, head_dim]: [n, heads · head_dim], before `o_proj`.
    pub(crate) fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, past: usize) -> candle_core::Result<Tensor> {
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let groups = nh / nkv;
        let n = q.dim(0)?;
        let total = past + n;
        // Query heads g*groups..(g+1)*groups share kv head g: fold them into rows.
        let q = q.transpose(0, 1)?.contiguous()?.reshape((nkv, groups * n, hd))?;
        let scale = (hd as f64).powf(-0.5);
        let probs = if q.device().is_cuda() {
            // One fused pass in f32 instead of scale, cast, mask, softmax and cast back.
            scaled_softmax(&q.matmul(&k.t()?)?, scale as f32, (n > 1).then_some((n, past)))?
        } else {
            let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?;
            let scores = if n > 1 {
                let mask = causal_mask(n, past, q.device())?;
                scores.reshape((nkv, groups, n, total))?.broadcast_add(&mask)?.reshape((nkv, groups * n, total))?
            } else {
                scores
            };
            candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?
        };
        let out = probs.matmul(v)?.reshape((nh, n, hd))?.transpose(0, 1)?;
        out.reshape((n, nh * hd))
    }

    /// One new token per sequence, all sequences at once: `q` [B, heads, head_dim],
    /// `k`, `v` [B, kv_heads, L, head_dim] (padded to the longest), `mask` [B, 1, 1, L]
    /// (0 for each sequence's own positions, -inf for the padding): [B, heads · head_dim].
    pub(crate) fn attend_decodes(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let b = q.dim(0)?;
        let q = q.reshape((b, nkv, nh / nkv, hd))?;
        let scale = (hd as f64).powf(-0.5);
        let scores = (q.matmul(&k.transpose(2, 3)?)? * scale)?.to_dtype(DType::F32)?.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
        probs.matmul(v)?.reshape((b, nh * hd))
    }

    /// Attention over contiguous per-sequence caches: `q`, `k`, `v` from [`project`](Self::project)
    /// hold the new rows of all `seqs`.
    fn forward_contiguous(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        seqs: &mut [SeqInput<'_>],
        layer: usize,
    ) -> candle_core::Result<Tensor> {
        let mut outs = Vec::with_capacity(seqs.len());
        let mut offset = 0;
        for seq in seqs.iter_mut() {
            let (n, past) = (seq.new_tokens, seq.cache.len);
            let rows = |x: &Tensor| x.narrow(0, offset, n)?.transpose(0, 1)?.contiguous();
            let (k, v) = seq.cache.append(layer, rows(k)?, rows(v)?)?;
            outs.push(self.attend(&q.narrow(0, offset, n)?, &k, &v, past)?);
            offset += n;
        }
        Tensor::cat(&outs, 0)
    }
}

/// `x += add` (when given), then `norm(x)`: one fused kernel on the GPU, candle's add
/// and RMSNorm on the CPU.
fn add_norm(norm: &RmsNorm, x: &mut Tensor, add: Option<Tensor>, fused: bool) -> candle_core::Result<Tensor> {
    match add {
        None => norm.forward(x),
        Some(y) if fused && x.dim(candle_core::D::Minus1)? <= ADD_RMSNORM_MAX_WIDTH => {
            let (sum, normed) = add_rmsnorm(x, &y, norm.weight(), norm.eps() as f32)?;
            *x = sum;
            Ok(normed)
        }
        Some(y) => {
            *x = (&*x + y)?;
            norm.forward(x)
        }
    }
}

/// [n, past + n]: 0 where query i (position past + i) may see key j, -inf elsewhere.
/// Made on the device: building it on the host cost a 7B model's 2,048-token prefill
/// most of its time (4M values per layer, then a copy).
fn causal_mask(n: usize, past: usize, device: &Device) -> candle_core::Result<Tensor> {
    let total = past + n;
    let rows = Tensor::arange(past as u32, total as u32, device)?.reshape((n, 1))?;
    let cols = Tensor::arange(0u32, total as u32, device)?.reshape((1, total))?;
    let visible = cols.broadcast_le(&rows)?;
    let zeros = Tensor::zeros((n, total), DType::F32, device)?;
    let hidden = Tensor::full(f32::NEG_INFINITY, (n, total), device)?;
    visible.where_cond(&zeros, &hidden)
}

/// The gate and up projections.
enum GateUp {
    /// The checkpoint's two, any activation (the CPU).
    Separate { gate: Linear, up: Linear, act: Activation },
    /// Stacked into one GEMM, then `silu_mul` (the GPU, for SiLU).
    FusedSilu(Linear),
}

struct Mlp {
    gate_up: GateUp,
    down_proj: Linear,
}

impl Mlp {
    fn load(s: &Scope, cfg: &LlamaConfig) -> Result<Self, ModelError> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        let (gate, up) = (s.linear("gate_proj", h, i, bias)?, s.linear("up_proj", h, i, bias)?);
        let act = Activation::from_name(&cfg.hidden_act)?;
        let gate_up = if s.device().is_cuda() && act == Activation::Silu {
            GateUp::FusedSilu(Linear::stack(&[gate, up])?)
        } else {
            GateUp::Separate { gate, up, act }
        };
        Ok(Mlp { gate_up, down_proj: s.linear("down_proj", i, h, bias)? })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = match &self.gate_up {
            GateUp::FusedSilu(gate_up) => gate_up.forward_silu_mul(x)?,
            GateUp::Separate { gate, up, act } => (act.apply(&gate.forward(x)?)? * up.forward(x)?)?,
        };
        self.down_proj.forward(&h)
    }
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// `LlamaForCausalLM`.
/// The rotary positions of a step's rows.
#[derive(Clone, Copy)]
pub(crate) enum Rope<'a> {
    /// One position per row.
    Linear(&'a [usize]),
    /// Qwen-VL's M-RoPE: temporal, height and width positions per row.
    Multi(&'a [Vec<i64>; 3]),
}

pub struct Llama {
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    /// [1, head_dim / 2] f32.
    inv_freq: Tensor,
    cfg: LlamaConfig,
    /// Whether prefill attention may take the flash kernels (`Kernels::flash_attention`).
    pub(crate) flash_attention: bool,
}

impl Llama {
    pub fn load(dir: &ModelDir, placement: &Placement) -> Result<Self, ModelError> {
        let weights = placement.weights(dir)?;
        Self::from_weights(&weights, dir.config.text())
    }

    pub fn from_weights(weights: &Weights, cfg: &LlamaConfig) -> Result<Self, ModelError> {
        match cfg.rope_type.as_str() {
            "default" => {}
            "mrope" if cfg.mrope_section.len() == 3 && 2 * cfg.mrope_section.iter().sum::<usize>() == cfg.head_dim => {}
            "mrope" => {
                return Err(ModelError::Unsupported(format!(
                    "mrope_section {:?} does not cover half of head_dim {}",
                    cfg.mrope_section, cfg.head_dim
                )));
            }
            other => return Err(ModelError::Unsupported(format!("rope_type {other:?}"))),
        }
        if !cfg.head_dim.is_multiple_of(2) {
            return Err(ModelError::Unsupported(format!("odd head_dim {}", cfg.head_dim)));
        }
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let lm = weights.language_model();
        let embed_tokens = lm.tensor("embed_tokens.weight", (cfg.vocab_size, h))?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let s = lm.pp("layers").pp(i);
                Ok(DecoderLayer {
                    input_layernorm: s.rms_norm("input_layernorm", h, eps)?,
                    self_attn: Attention::load(&s.pp("self_attn"), cfg)?,
                    post_attention_layernorm: s.rms_norm("post_attention_layernorm", h, eps)?,
                    mlp: Mlp::load(&s.pp("mlp"), cfg)?,
                })
            })
            .collect::<Result<_, ModelError>>()?;
        let head = weights.lm_head();
        let lm_head = if head.contains("weight") {
            Linear::new(head.tensor("weight", (cfg.vocab_size, h))?, None, weights.kernels())
        } else {
            Linear::new(embed_tokens.clone(), None, weights.kernels())
        };
        let half = cfg.head_dim / 2;
        let inv_freq: Vec<f32> =
            (0..half).map(|i| 1.0 / (cfg.rope_theta as f32).powf((2 * i) as f32 / cfg.head_dim as f32)).collect();
        Ok(Llama {
            inv_freq: Tensor::from_vec(inv_freq, (1, half), weights.device())?,
            embed_tokens,
            layers,
            norm: lm.rms_norm("norm", h, eps)?,
            lm_head,
            cfg: cfg.clone(),
            flash_attention: weights.kernels().flash_attention,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    /// An empty cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache { layers: vec![None; self.layers.len()], len: 0 }
    }

    /// Embedding rows for text token ids (ids < vocab_size): [n, hidden].
    /// The token embedding table [vocab, hidden] (for [`crate::ArenaRows::gather`]).
    pub fn embed_table(&self) -> &Tensor {
        &self.embed_tokens
    }

    pub fn embed_tokens(&self, ids: &[u32]) -> Result<Tensor, ModelError> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            return Err(ModelError::InvalidInput(format!(
                "token id {bad} is outside the vocabulary ({})",
                self.cfg.vocab_size
            )));
        }
        let ids = Tensor::new(ids, self.device())?;
        Ok(self.embed_tokens.index_select(&ids, 0)?)
    }

    /// One forward step over a batch of sequences whose new tokens are concatenated
    /// along dim 0 of `input_embeds` [total_new_tokens, hidden]. `seqs[i]` says how many
    /// of those rows belong to sequence i (in order) and carries its KV cache, which
    /// already holds `cache.len()` earlier tokens (positions 0..len; the new ones
    /// continue from there). Appends the new keys and values to each cache (on error,
    /// the caches are left as they were). Attention is causal within a sequence and
    /// never crosses sequences.
    ///
    /// Returns f32 logits [total_new_tokens, vocab] if `all_logits`, else only each
    /// sequence's last row: [seqs.len(), vocab].
    pub fn forward(
        &self,
        input_embeds: &Tensor,
        seqs: &mut [SeqInput<'_>],
        all_logits: bool,
    ) -> Result<Tensor, ModelError> {
        let hidden = self.forward_hidden(input_embeds, seqs, all_logits)?;
        Ok(self.lm_head.forward(&hidden)?.to_dtype(DType::F32)?)
    }

    /// [`forward`](Self::forward) without the LM head: the hidden states after the final
    /// norm, in the model dtype ([total_new_tokens, hidden] if `all_rows`, else
    /// [seqs.len(), hidden]).
    pub fn forward_hidden(
        &self,
        input_embeds: &Tensor,
        seqs: &mut [SeqInput<'_>],
        all_rows: bool,
    ) -> Result<Tensor, ModelError> {
        let (total, hidden) = input_embeds.dims2()?;
        if hidden != self.cfg.hidden_size {
            return Err(ModelError::InvalidInput(format!(
                "input_embeds has width {hidden}, the model {}",
                self.cfg.hidden_size
            )));
        }
        if seqs.is_empty() || seqs.iter().any(|s| s.new_tokens == 0) {
            return Err(ModelError::InvalidInput("every sequence needs a new token".into()));
        }
        if seqs.iter().map(|s| s.new_tokens).sum::<usize>() != total {
            return Err(ModelError::InvalidInput(format!(
                "new_tokens of the sequences do not add up to the {total} input rows"
            )));
        }
        if seqs.iter().any(|s| s.cache.layers.len() != self.layers.len()) {
            return Err(ModelError::InvalidInput("KV cache made for another model".into()));
        }
        match self.run(input_embeds, seqs, all_rows) {
            Ok(hidden) => {
                for s in seqs.iter_mut() {
                    s.cache.len += s.new_tokens;
                }
                Ok(hidden)
            }
            Err(e) => {
                for s in seqs.iter_mut() {
                    s.cache.rollback();
                }
                Err(e.into())
            }
        }
    }

    fn run(&self, input_embeds: &Tensor, seqs: &mut [SeqInput<'_>], all_rows: bool) -> candle_core::Result<Tensor> {
        let positions: Vec<usize> = seqs.iter().flat_map(|s| s.cache.len..s.cache.len + s.new_tokens).collect();
        self.run_contiguous(input_embeds, Rope::Linear(&positions), seqs, all_rows)
    }

    fn run_contiguous(
        &self,
        input_embeds: &Tensor,
        rope: Rope<'_>,
        seqs: &mut [SeqInput<'_>],
        all_rows: bool,
    ) -> candle_core::Result<Tensor> {
        let lens: Vec<usize> = seqs.iter().map(|s| s.new_tokens).collect();
        self.run_layers(input_embeds, rope, (!all_rows).then_some(&lens[..]), None, |layer, attn, q, kv| {
            let Some((k, v)) = kv else { candle_core::bail!("no keys and values for the contiguous cache") };
            attn.forward_contiguous((q, k, v), seqs, layer)
        })
    }

    /// One sequence's prompt at Qwen-VL's multimodal positions (`positions`: temporal,
    /// height and width ids per row, see `mmserve_media::mrope`), with no cache: f32
    /// logits [rows, vocab]. The parity tests' entry; serving carries the positions with
    /// the request.
    pub fn forward_mrope(&self, input_embeds: &Tensor, positions: &[Vec<i64>; 3]) -> Result<Tensor, ModelError> {
        if self.cfg.mrope_section.len() != 3 {
            return Err(ModelError::InvalidInput("the model has no mrope_section".into()));
        }
        let n = input_embeds.dim(0)?;
        if positions.iter().any(|p| p.len() != n) {
            return Err(ModelError::InvalidInput(format!("positions for {n} rows expected")));
        }
        let mut cache = self.new_cache();
        let mut seqs = [SeqInput { new_tokens: n, cache: &mut cache }];
        let hidden = self.run_contiguous(input_embeds, Rope::Multi(positions), &mut seqs, true)?;
        Ok(self.lm_head.forward(&hidden)?.to_dtype(DType::F32)?)
    }

    /// cos and sin [rows, head_dim / 2] of the rotary angles at `rope`'s positions: one
    /// position per row, or for M-RoPE the temporal, height and width positions, each
    /// turning its section of the frequencies.
    fn rotary(&self, rope: Rope<'_>, rows: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let angles = match rope {
            Rope::Linear(positions) => {
                let positions: Vec<f32> = positions.iter().map(|&p| p as f32).collect();
                Tensor::from_vec(positions, (rows, 1), self.device())?.broadcast_mul(&self.inv_freq)?
            }
            Rope::Multi(streams) => {
                let half = self.cfg.head_dim / 2;
                let stream_of: Vec<usize> =
                    (0..3).flat_map(|s| std::iter::repeat_n(s, self.cfg.mrope_section[s])).collect();
                let p: Vec<f32> =
                    (0..rows).flat_map(|r| stream_of.iter().map(move |&s| streams[s][r] as f32)).collect();
                Tensor::from_vec(p, (rows, half), self.device())?.broadcast_mul(&self.inv_freq)?
            }
        };
        Ok((angles.cos()?.to_dtype(self.dtype())?, angles.sin()?.to_dtype(self.dtype())?))
    }

    /// The decoder stack over `input_embeds` [T, hidden] at `positions` (one per row):
    /// `attention(layer, attn, q, Some((k, v)))` gives each layer's attention output before
    /// `o_proj`; with `pools`, layers whose projection writes k and v into their slots
    /// itself pass `None` instead. With `last_of`, only the last row of each run of that
    /// many rows is kept.
    pub(crate) fn run_layers(
        &self,
        input_embeds: &Tensor,
        rope: Rope<'_>,
        last_of: Option<&[usize]>,
        pools: Option<LayerPools<'_>>,
        mut attention: impl FnMut(usize, &Attention, &Tensor, Option<(&Tensor, &Tensor)>) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let (cos, sin) = self.rotary(rope, input_embeds.dim(0)?)?;

        // The residual stream `x` and the block output still to be added to it: on the
        // GPU each addition happens in the kernel of the norm that follows it.
        let fused = self.device().is_cuda();
        let mut x = input_embeds.to_dtype(self.dtype())?;
        let mut pending: Option<Tensor> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = add_norm(&layer.input_layernorm, &mut x, pending.take(), fused)?;
            let attn = &layer.self_attn;
            let layer_pools = pools.map(|p| PoolSlots { k: &p.k[i], v: &p.v[i], slots: p.slots });
            let (q, kv) = attn.project(&h, &cos, &sin, layer_pools)?;
            let out = attn.o_proj.forward(&attention(i, attn, &q, kv.as_ref().map(|(k, v)| (k, v)))?)?;
            let h = add_norm(&layer.post_attention_layernorm, &mut x, Some(out), fused)?;
            pending = Some(layer.mlp.forward(&h)?);
        }
        if let Some(lens) = last_of {
            let mut end = 0u32;
            let last: Vec<u32> = lens
                .iter()
                .map(|&n| {
                    end += n as u32;
                    end - 1
                })
                .collect();
            let last = Tensor::new(last, self.device())?;
            x = x.index_select(&last, 0)?;
            pending = pending.map(|p| p.index_select(&last, 0)).transpose()?;
        }
        add_norm(&self.norm, &mut x, pending, fused)
    }

    pub(crate) fn lm_head(&self) -> &Linear {
        &self.lm_head
    }

    pub(crate) fn num_layers(&self) -> usize {
        self.layers.len()
    }
}
