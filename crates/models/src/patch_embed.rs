//! The ViT patch embedding (a conv whose stride is its kernel) as unfold + GEMM + one pass
//! that adds the class row and the positions (`mmserve_ops::patch_embed`). On CLIP-L/336
//! at a batch of 32 images candle's conv, transposes, cat and broadcast add cost about
//! 1 ms; the unfold and the pass move the same bytes once each. The ops' CPU twins are
//! checked against candle's conv below.

use candle_core::{DType, Module, Tensor};
use mmserve_ops::Kernels;
use mmserve_ops::patch_embed::{add_positions, unfold};

use crate::linear::Linear;

/// The conv's weight as a GEMM's: [D, C · p²] padded with zero columns to a multiple of 8.
#[derive(Debug, Clone)]
pub(crate) struct PatchEmbed {
    gemm: Linear,
    patch: usize,
    width: usize,
}

impl PatchEmbed {
    /// From the conv weight [D, C, p, p].
    pub(crate) fn new(conv: &Tensor, kernels: Kernels) -> candle_core::Result<Self> {
        let (d, c, p, _) = conv.dims4()?;
        let k = c * p * p;
        let width = k.next_multiple_of(8);
        let w = conv.reshape((d, k))?;
        let w = if width > k { Tensor::cat(&[&w, &w.zeros_like()?.narrow(1, 0, width - k)?], 1)? } else { w };
        Ok(PatchEmbed { gemm: Linear::new(w, None, kernels), patch: p, width })
    }

    /// `pixels` [B, C, S, S], `class` [D], `positions` [1 + (S/p)², D] → [B, 1 + (S/p)², D].
    pub(crate) fn forward(&self, pixels: &Tensor, class: &Tensor, positions: &Tensor) -> candle_core::Result<Tensor> {
        let (b, _, s, _) = pixels.dims4()?;
        let dtype = self.gemm_dtype();
        let rows = unfold(pixels, self.patch, self.width, dtype)?;
        let patches = self.gemm.forward(&rows)?;
        let tokens = (s / self.patch).pow(2) + 1;
        let out = add_positions(&patches, class, positions, b)?;
        out.reshape((b, tokens, ()))
    }

    fn gemm_dtype(&self) -> DType {
        self.gemm.dtype()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Unfold, GEMM and positions through the twins equal candle's conv, cat and add.
    #[test]
    fn twins_equal_the_conv() {
        let dev = Device::Cpu;
        let (b, c, s, p, d) = (2, 3, 10, 5, 6);
        let px = Tensor::randn(0f32, 1.0, (b, c, s, s), &dev).unwrap();
        let conv = Tensor::randn(0f32, 1.0, (d, c, p, p), &dev).unwrap();
        let tokens = (s / p) * (s / p) + 1;
        let cls = Tensor::randn(0f32, 1.0, d, &dev).unwrap();
        let pos = Tensor::randn(0f32, 1.0, (tokens, d), &dev).unwrap();
        let got = PatchEmbed::new(&conv, Kernels::default()).unwrap().forward(&px, &cls, &pos).unwrap();
        let patches = px.conv2d(&conv, 0, p, 1, 1).unwrap().flatten_from(2).unwrap().transpose(1, 2).unwrap();
        let cls_rows = cls.reshape((1, 1, d)).unwrap().broadcast_as((b, 1, d)).unwrap();
        let want = Tensor::cat(&[&cls_rows, &patches], 1).unwrap().broadcast_add(&pos).unwrap();
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-4, "{diff}");
    }
}
