//! Activation functions by their transformers `ACT2FN` names, as read from
//! `CLIPVisionConfig.hidden_act`, `LlavaConfig.projector_hidden_act` and
//! `LlamaConfig.hidden_act`.

use candle_core::Tensor;

use crate::ModelError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `gelu`: exact, with erf.
    Gelu,
    /// `gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`: the tanh approximation.
    GeluTanh,
    /// `quick_gelu`: `x * sigmoid(1.702 x)` (CLIP).
    QuickGelu,
    /// `silu` / `swish`.
    Silu,
    Relu,
}

impl Activation {
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        Ok(match name {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "quick_gelu" => Activation::QuickGelu,
            "silu" | "swish" => Activation::Silu,
            "relu" => Activation::Relu,
            other => return Err(ModelError::Unsupported(format!("activation {other:?}"))),
        })
    }

    /// The name stem of `kernels/fused.cu`'s kernel for this activation, where there is one.
    pub(crate) fn fused_stem(self) -> Option<&'static str> {
        match self {
            Activation::Gelu => Some("gelu_erf"),
            Activation::QuickGelu => Some("quick_gelu"),
            _ => None,
        }
    }

    pub fn apply(self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Activation::Gelu if x.device().is_cuda() => mmserve_ops::fused::gelu_erf(x),
            Activation::Gelu => x.gelu_erf(),
            Activation::GeluTanh => x.gelu(),
            // One pass on the GPU (`kernels/fused.cu`); candle's ops on the CPU.
            Activation::QuickGelu if x.device().is_cuda() => mmserve_ops::fused::quick_gelu(x),
            Activation::QuickGelu => x * candle_nn::ops::sigmoid(&(x * 1.702)?)?,
            Activation::Silu => x.silu(),
            Activation::Relu => x.relu(),
        }
    }
}
