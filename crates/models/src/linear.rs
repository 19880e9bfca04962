//! `nn.Linear` (y = x·Wᵀ + b over the last dim). On the CPU exactly candle's `Linear`
//! (whose results the parity tests pin down). On the GPU the leading dims fold into one
//! GEMM (not a batch of them over a broadcast weight) and the bias is added by our fused
//! kernel: candle's broadcast add was the vision tower's largest elementwise cost. In
//! 16-bit, from 32 rows, the bias (and a residual, [`Linear::forward_residual`]) ride in a
//! cuBLASLt GEMM's epilogue instead (`gemm_epilogue.rs`). One row (decode steps) takes our
//! skinny kernel, bias included (`skinny.rs`), and for a stacked gate and up projection
//! the SiLU product too ([`Linear::forward_silu_mul`]).

use candle_core::{Module, Tensor};
use mmserve_ops::Kernels;

use crate::activation::Activation;
use mmserve_ops::fused::add_bias;
use mmserve_ops::gemm_epilogue;

#[derive(Debug, Clone)]
pub struct Linear {
    inner: candle_nn::Linear,
    kernels: Kernels,
}

impl Linear {
    /// `weight` [out, in], `bias` [out]; `kernels`: which GEMM paths it may take.
    pub fn new(weight: Tensor, bias: Option<Tensor>, kernels: Kernels) -> Self {
        Linear { inner: candle_nn::Linear::new(weight, bias), kernels }
    }

    pub fn dtype(&self) -> candle_core::DType {
        self.inner.weight().dtype()
    }

    /// One layer computing `parts`' outputs side by side (their weights stacked): one GEMM
    /// where there were several. The parts must agree on having a bias.
    pub fn stack(parts: &[Linear]) -> candle_core::Result<Linear> {
        let weights: Vec<&Tensor> = parts.iter().map(|p| p.inner.weight()).collect();
        let biases: Option<Vec<&Tensor>> = parts.iter().map(|p| p.inner.bias()).collect();
        if biases.is_none() && parts.iter().any(|p| p.inner.bias().is_some()) {
            candle_core::bail!("Linear::stack: some parts have a bias and some not");
        }
        let bias = biases.map(|b| Tensor::cat(&b, 0)).transpose()?;
        let kernels = parts.first().map_or_else(Kernels::default, |p| p.kernels);
        Ok(Linear::new(Tensor::cat(&weights, 0)?, bias, kernels))
    }
}

impl Linear {
    /// `silu(g) · u` where this layer stacks a gate and an up projection (`[g | u]` =
    /// x·Wᵀ + b, see [`Linear::stack`]) and x is [rows, in]: [rows, out / 2]. On the GPU
    /// at few rows one skinny launch; elsewhere the layer, then `silu_mul`.
    pub fn forward_silu_mul(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if x.device().is_cuda()
            && x.rank() == 2
            && let Some(y) = mmserve_ops::skinny::linear_silu(x, self.inner.weight(), self.inner.bias())?
        {
            return Ok(y);
        }
        mmserve_ops::decoder_fused::silu_mul(&self.forward(x)?)
    }

    /// `act(x·Wᵀ + b)`: on the GPU in 16-bit, where `act` has a fused kernel, the GEMM
    /// with the bias in its epilogue, then the activation in place
    /// (`gemm_epilogue::linear_act`); elsewhere the layer, then the activation.
    pub fn forward_act(&self, x: &Tensor, act: Activation) -> candle_core::Result<Tensor> {
        let (w, dims) = (self.inner.weight(), x.dims());
        if x.device().is_cuda()
            && let Some(stem) = act.fused_stem()
        {
            let k = dims.last().copied().unwrap_or(1);
            let flat = x.reshape((x.elem_count() / k.max(1), k))?;
            if let Some(y) = gemm_epilogue::linear_act(&flat, w, self.inner.bias(), stem, &self.kernels)? {
                let mut out = dims.to_vec();
                if let Some(last) = out.last_mut() {
                    *last = w.dim(0)?;
                }
                return y.reshape(out);
            }
        }
        act.apply(&self.forward(x)?)
    }

    /// `residual + x·Wᵀ + b`: on the GPU in 16-bit one GEMM with both in its epilogue
    /// (`gemm_epilogue.rs`); elsewhere the layer, then the add.
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> candle_core::Result<Tensor> {
        let (w, dims) = (self.inner.weight(), x.dims());
        let k = dims.last().copied().unwrap_or(1);
        if x.device().is_cuda() {
            let rows = x.elem_count() / k.max(1);
            let flat = (x.reshape((rows, k))?, residual.reshape((rows, w.dim(0)?))?);
            if let Some(y) = gemm_epilogue::linear(&flat.0, w, self.inner.bias(), Some(&flat.1), &self.kernels)? {
                return y.reshape(residual.shape());
            }
        }
        residual + self.forward(x)?
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if !x.device().is_cuda() {
            return self.inner.forward(x);
        }
        let (w, dims) = (self.inner.weight(), x.dims());
        let k = dims.last().copied().unwrap_or(1);
        let x = x.reshape((x.elem_count() / k.max(1), k))?;
        let y = if let Some(y) = mmserve_ops::skinny::linear(&x, w, self.inner.bias())? {
            y
        } else if let Some(y) = gemm_epilogue::linear(&x, w, self.inner.bias(), None, &self.kernels)? {
            y
        } else {
            let y = x.matmul(&w.t()?)?;
            match self.inner.bias() {
                Some(b) => add_bias(&y, b)?,
                None => y,
            }
        };
        let mut out = dims.to_vec();
        if let Some(last) = out.last_mut() {
            *last = w.dim(0)?;
        }
        y.reshape(out)
    }
}
