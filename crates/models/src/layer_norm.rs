//! LayerNorm (Ba et al. 2016, "Layer Normalization") over the last dim, as torch's
//! `nn.LayerNorm` with a weight and a bias: the encoders' norms (CLIP's `layer_norm1`,
//! `layer_norm2`, `pre_layrnorm`; Whisper's). On the CPU exactly candle's `LayerNorm`, whose
//! results the parity tests pin down; on the GPU `mmserve_ops::layer_norm`, with the
//! residual add before the norm in the same pass ([`LayerNorm::add_forward`]).

use candle_core::{Module, Tensor};
use mmserve_ops::layer_norm::{fits, norm};

#[derive(Debug, Clone)]
pub struct LayerNorm {
    inner: candle_nn::LayerNorm,
}

impl LayerNorm {
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        LayerNorm { inner: candle_nn::LayerNorm::new(weight, bias, eps) }
    }

    /// `(x + y, layer_norm(x + y))`: the residual stream and its norm, in one pass on the GPU.
    pub fn add_forward(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        if !fits(x) {
            let sum = (x + y)?;
            let normed = self.inner.forward(&sum)?;
            return Ok((sum, normed));
        }
        let out = norm(&x.contiguous()?, Some(&y.contiguous()?), &self.inner)?;
        let rows = x.elem_count() / x.dims().last().copied().unwrap_or(1);
        Ok((out.narrow(0, 0, rows)?.reshape(x.shape())?, out.narrow(0, rows, rows)?.reshape(x.shape())?))
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if !fits(x) {
            return self.inner.forward(x);
        }
        norm(&x.contiguous()?, None, &self.inner)?.reshape(x.shape())
    }
}
