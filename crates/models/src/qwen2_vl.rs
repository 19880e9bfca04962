//! The Qwen-VL vision towers: Qwen2-VL's (`Qwen2VisionTransformerPretrainedModel`, Wang
//! et al. 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at
//! Any Resolution") and Qwen2.5-VL's (`Qwen2_5_VisionTransformerPretrainedModel`, Bai et
//! al. 2025: RMSNorm, a SwiGLU MLP, and window attention, the patches permuted into
//! windows and back). The patch embedding over `temporal_patch_size × patch_size²` values
//! (transformers' Conv3d, whose stride is its kernel: one GEMM), pre-norm blocks of
//! attention with 2-D rotary positions (height, width) and an MLP, attention within
//! each frame of each image only (a batch of images is one packed sequence, never padded
//! to the largest), and the patch merger (LayerNorm, then an MLP over each
//! `spatial_merge_size²` group of patches, which the preprocessor laid out
//! consecutively). Reads `vision_config` through `Qwen2VisionConfig`.

use candle_core::{D, DType, Device, Module, Tensor};
use mmserve_config::Qwen2VisionConfig;
use mmserve_ops::flash_attention::{self, Segments};

use crate::ModelError;
use crate::activation::Activation;
use crate::layer_norm::LayerNorm;
use crate::linear::Linear;
use crate::weights::{Scope, Weights};

/// LayerNorm's epsilon throughout the tower.
const EPS: f64 = 1e-6;
/// The rotary embedding's base.
const THETA: f64 = 10_000.0;

/// LayerNorm (Qwen2-VL) or RMSNorm (Qwen2.5-VL).
enum Norm {
    Layer(LayerNorm),
    Rms(candle_nn::RmsNorm),
}

impl Norm {
    fn load(s: &Scope, name: &str, d: usize, rms: bool) -> Result<Self, ModelError> {
        Ok(if rms { Norm::Rms(s.rms_norm(name, d, EPS)?) } else { Norm::Layer(s.layer_norm(name, d, EPS)?) })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Norm::Layer(n) => n.forward(x),
            Norm::Rms(n) => n.forward(x),
        }
    }
}

/// `fc2(act(fc1(x)))` (Qwen2-VL) or `down(act(gate(x)) · up(x))` (Qwen2.5-VL).
enum Mlp {
    Plain { fc1: Linear, fc2: Linear },
    Gated { gate: Linear, up: Linear, down: Linear },
}

impl Mlp {
    fn forward(&self, x: &Tensor, act: Activation) -> candle_core::Result<Tensor> {
        match self {
            Mlp::Plain { fc1, fc2 } => fc2.forward(&act.apply(&fc1.forward(x)?)?),
            Mlp::Gated { gate, up, down } => down.forward(&(act.apply(&gate.forward(x)?)? * up.forward(x)?)?),
        }
    }
}

struct Block {
    norm1: Norm,
    qkv: Linear,
    proj: Linear,
    norm2: Norm,
    mlp: Mlp,
}

pub struct Qwen2VisionTower {
    patch: Linear,
    blocks: Vec<Block>,
    ln_q: Norm,
    merge_fc1: Linear,
    merge_fc2: Linear,
    act: Activation,
    cfg: Qwen2VisionConfig,
    /// Whether the flash kernels may take the attention (`Kernels::flash_attention`).
    flash: bool,
}

/// One image (or video) in patches: frames, rows, columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    pub t: usize,
    pub h: usize,
    pub w: usize,
}

impl Grid {
    fn patches(&self) -> usize {
        self.t * self.h * self.w
    }
}

impl Block {
    fn load(s: &Scope, d: usize, hidden: usize, v25: bool) -> Result<Self, ModelError> {
        let mlp = if v25 {
            Mlp::Gated {
                gate: s.linear("mlp.gate_proj", d, hidden, true)?,
                up: s.linear("mlp.up_proj", d, hidden, true)?,
                down: s.linear("mlp.down_proj", hidden, d, true)?,
            }
        } else {
            Mlp::Plain { fc1: s.linear("mlp.fc1", d, hidden, true)?, fc2: s.linear("mlp.fc2", hidden, d, true)? }
        };
        Ok(Block {
            norm1: Norm::load(s, "norm1", d, v25)?,
            qkv: s.linear("attn.qkv", d, 3 * d, true)?,
            proj: s.linear("attn.proj", d, d, true)?,
            norm2: Norm::load(s, "norm2", d, v25)?,
            mlp,
        })
    }
}

impl Qwen2VisionTower {
    pub fn from_weights(weights: &Weights, cfg: &Qwen2VisionConfig) -> Result<Self, ModelError> {
        let s = weights.visual();
        let d = cfg.embed_dim;
        let conv = s.tensor(
            "patch_embed.proj.weight",
            (d, cfg.in_chans, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
        )?;
        let patch = Linear::new(conv.reshape((d, cfg.patch_values()))?, None, weights.kernels());
        let v25 = cfg.window.is_some();
        let blocks = (0..cfg.depth)
            .map(|i| Block::load(&s.pp("blocks").pp(i), d, cfg.mlp_hidden, v25))
            .collect::<Result<_, _>>()?;
        let merged = d * cfg.spatial_merge_size * cfg.spatial_merge_size;
        Ok(Qwen2VisionTower {
            patch,
            blocks,
            ln_q: Norm::load(&s, "merger.ln_q", d, v25)?,
            merge_fc1: s.linear("merger.mlp.0", merged, merged, true)?,
            merge_fc2: s.linear("merger.mlp.2", merged, cfg.hidden_size, true)?,
            act: Activation::from_name(&cfg.hidden_act)?,
            cfg: cfg.clone(),
            flash: weights.kernels().flash_attention,
        })
    }

    /// Whether the attention may take the flash kernels (on by `Kernels::flash_attention`);
    /// off, candle's ops in f32: the benchmark's cross-check of the kernels at real shapes.
    pub fn set_flash_attention(&mut self, on: bool) {
        self.flash = on;
    }

    /// Embedding rows of the images: `pixels` [patches, patch values] in the
    /// preprocessor's order, `grids` the images' patch grids in that order →
    /// [patches / merge², hidden_size].
    pub fn forward(&self, pixels: &Tensor, grids: &[Grid]) -> Result<Tensor, ModelError> {
        Ok(self.forward_layers(pixels, grids)?.1)
    }

    /// [`forward`](Self::forward), with every block's output (the parity tests' view; in
    /// window order for Qwen2.5-VL, as transformers' blocks see them).
    pub fn forward_layers(&self, pixels: &Tensor, grids: &[Grid]) -> Result<(Vec<Tensor>, Tensor), ModelError> {
        let n: usize = grids.iter().map(Grid::patches).sum();
        let (rows, values) = pixels.dims2()?;
        if rows != n || values != self.cfg.patch_values() {
            return Err(ModelError::InvalidInput(format!(
                "pixel values [{rows}, {values}] for grids of {n} patches of {} values",
                self.cfg.patch_values()
            )));
        }
        let m = self.cfg.spatial_merge_size;
        if let Some(g) = grids.iter().find(|g| !g.h.is_multiple_of(m) || !g.w.is_multiple_of(m)) {
            return Err(ModelError::InvalidInput(format!("grid {g:?} is not a multiple of the merge size {m}")));
        }
        let dtype = self.patch.dtype();
        let mut x = self.patch.forward(&pixels.to_dtype(dtype)?)?;
        let mut angles = self.rotary(grids, x.device())?;
        // Attention runs within each frame: h·w patches at a time.
        let frames: Vec<usize> = grids.iter().flat_map(|g| std::iter::repeat_n(g.h * g.w, g.t)).collect();
        // Qwen2.5-VL: patches regrouped into windows (whole merge groups at a time).
        let windows = match &self.cfg.window {
            Some(w) => {
                let (order, lens) = window_order(grids, m, w.window_size / m / self.cfg.patch_size);
                let unit = m * m;
                let rows: Vec<u32> =
                    order.iter().flat_map(|&u| (0..unit).map(move |i| (u * unit + i) as u32)).collect();
                let rows = Tensor::new(rows.as_slice(), x.device())?;
                x = x.index_select(&rows, 0)?;
                angles = angles.index_select(&rows, 0)?;
                Some((order, lens.iter().map(|l| l * unit).collect::<Vec<_>>(), &w.fullatt_block_indexes))
            }
            None => None,
        };
        let head_dim = self.cfg.embed_dim / self.cfg.num_heads;
        let attention = if self.flash && flash_attention::applies_varlen(x.device(), dtype, head_dim) {
            let device = x.device();
            Attention::Flash {
                cos: angles.cos()?.to_dtype(dtype)?,
                sin: angles.sin()?.to_dtype(dtype)?,
                frames: Segments::new(&frames, device)?,
                windows: windows.as_ref().map(|(_, lens, _)| Segments::new(lens, device)).transpose()?,
            }
        } else {
            // Each angle turns dimensions i and i + head_dim / 2 (`rotate_half`).
            let twice = |t: Tensor| -> candle_core::Result<Tensor> { Tensor::cat(&[&t, &t], D::Minus1)?.unsqueeze(1) };
            Attention::Plain { cos: twice(angles.cos()?)?, sin: twice(angles.sin()?)? }
        };
        let mut layers = Vec::with_capacity(self.blocks.len());
        for (i, b) in self.blocks.iter().enumerate() {
            let windowed = matches!(&windows, Some((_, _, full)) if !full.contains(&i));
            let segments = match &windows {
                Some((_, lens, _)) if windowed => lens.as_slice(),
                _ => frames.as_slice(),
            };
            let h = b.norm1.forward(&x)?;
            let attn = match &attention {
                Attention::Plain { cos, sin } => self.attention(b, &h, cos, sin, segments)?,
                Attention::Flash { cos, sin, frames, windows } => {
                    let segments = match windows {
                        Some(w) if windowed => w,
                        _ => frames,
                    };
                    let qkv = b.qkv.forward(&h)?;
                    let heads = self.cfg.num_heads;
                    let (q, k, v) = mmserve_ops::decoder_fused::rope_split(&qkv, cos, sin, (heads, heads, head_dim))?;
                    flash_attention::varlen(&q, &k, &v, segments, (head_dim as f32).powf(-0.5))?
                }
            };
            x = (x + b.proj.forward(&attn)?)?;
            let h = b.norm2.forward(&x)?;
            x = (&x + b.mlp.forward(&h, self.act)?)?;
            layers.push(x.clone());
        }
        let merged = self.ln_q.forward(&x)?.reshape((n / (m * m), ()))?;
        let mut out = self.merge_fc2.forward(&Activation::Gelu.apply(&self.merge_fc1.forward(&merged)?)?)?;
        if let Some((order, _, _)) = &windows {
            // Back to the image's order: row `order[j]` of the output is merged row j.
            let mut back = vec![0u32; order.len()];
            for (j, &u) in order.iter().enumerate() {
                back[u] = j as u32;
            }
            out = out.index_select(&Tensor::new(back.as_slice(), out.device())?, 0)?;
        }
        Ok((layers, out))
    }

    /// The rotary angles [patches, head_dim / 2] (f32) of each patch's 2-D position: the
    /// first half of the frequencies turn with the row, the second with the column.
    fn rotary(&self, grids: &[Grid], device: &Device) -> Result<Tensor, ModelError> {
        let head_dim = self.cfg.embed_dim / self.cfg.num_heads;
        let dim = head_dim / 2;
        let inv: Vec<f64> = (0..dim / 2).map(|i| 1.0 / THETA.powf((2 * i) as f64 / dim as f64)).collect();
        let m = self.cfg.spatial_merge_size;
        let n: usize = grids.iter().map(Grid::patches).sum();
        let mut angles = Vec::with_capacity(n * dim);
        for g in grids {
            for _ in 0..g.t {
                // Patches come merge group by merge group: block row, block column, then
                // the group's own rows and columns.
                for (bh, bw, ih, iw) in itertools_product(g.h / m, g.w / m, m) {
                    let (row, col) = ((bh * m + ih) as f64, (bw * m + iw) as f64);
                    angles.extend(inv.iter().map(|f| (row * f) as f32).chain(inv.iter().map(|f| (col * f) as f32)));
                }
            }
        }
        Ok(Tensor::from_vec(angles, (n, dim), device)?)
    }

    /// Multi-head attention of `h` [patches, dim] within each frame, rotary on q and k.
    fn attention(
        &self,
        b: &Block,
        h: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        frames: &[usize],
    ) -> Result<Tensor, ModelError> {
        let (n, d) = h.dims2()?;
        let heads = self.cfg.num_heads;
        let hd = d / heads;
        let qkv = b.qkv.forward(h)?.reshape((n, 3, heads, hd))?;
        let dtype = qkv.dtype();
        let rope = |x: Tensor| -> candle_core::Result<Tensor> {
            let x = x.to_dtype(DType::F32)?;
            let (x1, x2) = (x.narrow(D::Minus1, 0, hd / 2)?, x.narrow(D::Minus1, hd / 2, hd / 2)?);
            let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
            (x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?.to_dtype(dtype)
        };
        let q = rope(qkv.narrow(1, 0, 1)?.squeeze(1)?)?;
        let k = rope(qkv.narrow(1, 1, 1)?.squeeze(1)?)?;
        let v = qkv.narrow(1, 2, 1)?.squeeze(1)?;
        let scale = (hd as f64).powf(-0.5);
        let mut outs = Vec::with_capacity(frames.len());
        let mut at = 0;
        for &len in frames {
            let part = |x: &Tensor| x.narrow(0, at, len)?.transpose(0, 1)?.contiguous();
            let (qs, ks, vs) = (part(&q)?, part(&k)?, part(&v)?);
            let scores = (qs.to_dtype(DType::F32)?.matmul(&ks.to_dtype(DType::F32)?.t()?)? * scale)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(dtype)?;
            outs.push(probs.matmul(&vs)?.transpose(0, 1)?);
            at += len;
        }
        Ok(Tensor::cat(&outs, 0)?.reshape((n, d))?)
    }
}

/// How a forward runs its attention, with the tables every block shares.
enum Attention {
    /// Candle's ops in f32, segment by segment (the CPU; f32 on the GPU): cos and sin
    /// [patches, 1, head_dim].
    Plain { cos: Tensor, sin: Tensor },
    /// The GPU in 16 bits: rotary in `rope_split`'s kernel (cos and sin [patches,
    /// head_dim / 2]), then one varlen flash launch over all images (or windows).
    Flash { cos: Tensor, sin: Tensor, frames: Segments, windows: Option<Segments> },
}

/// Qwen2.5-VL's windows over merge groups: each frame's grid of merged patches cut into
/// windows of `size × size` groups (the last ones in each direction short), row by
/// row of windows. Returns the merge groups in window order and each window's group
/// count (windows that hold none left out).
fn window_order(grids: &[Grid], m: usize, size: usize) -> (Vec<usize>, Vec<usize>) {
    let (mut order, mut lens) = (Vec::new(), Vec::new());
    let mut base = 0;
    for g in grids {
        let (gh, gw) = (g.h / m, g.w / m);
        for t in 0..g.t {
            for wy in (0..gh).step_by(size) {
                for wx in (0..gw).step_by(size) {
                    let before = order.len();
                    for y in wy..(wy + size).min(gh) {
                        for x in wx..(wx + size).min(gw) {
                            order.push(base + (t * gh + y) * gw + x);
                        }
                    }
                    lens.push(order.len() - before);
                }
            }
        }
        base += g.t * gh * gw;
    }
    (order, lens)
}

/// (block row, block column, row in block, column in block), in that nesting order.
fn itertools_product(bh: usize, bw: usize, m: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    (0..bh).flat_map(move |a| (0..bw).flat_map(move |b| (0..m).flat_map(move |c| (0..m).map(move |d| (a, b, c, d)))))
}
