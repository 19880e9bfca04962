//! The kernel choices that are settings: resolved once, from the encoder's and the
//! engine's flags (`mmserve_models::PlacementArgs`), carried by the placement into the
//! model, and handed to the ops that choose. Everything else about which kernel runs is
//! decided by the device and the shapes alone.

/// Which of our kernels a model takes where more than one path exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    /// Our flash attention where it applies (`flash_attention::applies`); off: the
    /// GEMM-and-softmax path, for comparing the two.
    pub flash_attention: bool,
    /// On compute capability 9.0, a linear layer an activation follows runs as our
    /// warp-specialised GEMM with the bias and the activation in its epilogue
    /// (`gemm_wgmma`); off: cuBLASLt's GEMM, then the activation in place. Ahead on the
    /// H100, within noise on the H200 (`kernels/README.md`).
    pub gemm_wgmma: bool,
    /// cuBLASLt algorithms timed for each new GEMM shape of 4,096 rows or more (0 or 1:
    /// the heuristic's first, untimed).
    pub gemm_tune_candidates: usize,
}

impl Default for Kernels {
    fn default() -> Self {
        Kernels { flash_attention: true, gemm_wgmma: true, gemm_tune_candidates: 8 }
    }
}
