//! `act(x·Wᵀ + b)` in one kernel of ours on Hopper (`kernels/gemm_wgmma.cu`: TMA, warp-group
//! MMAs, a producer warp group and two consumers in ping-pong), for the encoders' linear
//! layers that an activation follows: CLIP's fc1 and quick_gelu above all, which cuBLASLt
//! cannot fuse (it has no quick_gelu epilogue), so that the activation's pass over the
//! `[M, N]` output is saved.
//!
//! It rounds as [`crate::gemm_epilogue`]'s GEMM-then-pass does (the biased sum to the
//! dtype once, then the same activation code), and takes the shapes it covers
//! ([`covers`]); `gemm_epilogue::linear_act` calls it first and its self-test checks it.
//! On by default where it is compiled for (compute capability 9.0): CLIP-L's tower at 32
//! images measured 23.5-24.0 ms against 24.0-24.5 for cuBLASLt and the pass on an H100,
//! 23.6-23.7 against 23.9-24.9 on the H200 (2026-12-06). `Kernels::gemm_wgmma` (the
//! `--no-gemm-wgmma` flag) turns it off, to weigh one path against the other.

#[cfg(feature = "cuda")]
pub use cuda::launch;

/// Fewest rows for which the persistent kernel is taken: it fills the GPU with 128×128
/// output tiles, two a CTA at a time, and below a few waves of them cuBLASLt's choice of
/// tile wins.
#[cfg(feature = "cuda")]
const MIN_ROWS: usize = 2048;

/// Whether the kernel covers x [m, k] · w [n, k]ᵀ on `device`: compute capability 9.0
/// (sm_90a code), K a multiple of 64, N of 128, enough rows (whether to take it is
/// `Kernels::gemm_wgmma`).
#[cfg(feature = "cuda")]
pub fn covers(device: &candle_core::Device, m: usize, n: usize, k: usize) -> bool {
    m >= MIN_ROWS && n.is_multiple_of(128) && k.is_multiple_of(64) && crate::device_caps::is_sm90(device)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::DType;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg, sys};

    const MODULE: crate::launch::Module = crate::launch::module!("gemm_wgmma");
    /// The kernel's ring (GW_STAGES stages of a 128×64 x block and a 128×64 W block), its
    /// barriers, and 1024 bytes to align the ring to the swizzle's period.
    const SHARED: usize = 1024 + 6 * 2 * 128 * 64 * 2 + 2 * 6 * 8;

    /// A TMA descriptor, passed by value as a `__grid_constant__` kernel parameter.
    #[repr(transparent)]
    struct TensorMap(sys::CUtensorMap);
    // SAFETY: a plain-old-data struct of the driver's, laid out (and aligned) as the
    // kernel's `CUtensorMap` parameter.
    unsafe impl DeviceRepr for TensorMap {}

    /// The descriptor of a row-major [rows, cols] matrix of 16-bit values at `at`, read in
    /// boxes of 128 rows × 64 columns (128 bytes, the 128-byte swizzle the kernel's
    /// descriptors name); rows past the end read as zeros.
    fn tensor_map(at: u64, rows: usize, cols: usize, data: sys::CUtensorMapDataType) -> candle_core::Result<TensorMap> {
        let dims = [cols as u64, rows as u64];
        let strides = [(cols * 2) as u64];
        let boxes = [64u32, 128];
        let steps = [1u32, 1];
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: the arrays hold rank (2) entries, rank - 1 for the strides; the driver only
        // encodes the descriptor (it reads no device memory), writing `map`.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                data,
                2,
                at as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()
            .w()?;
            Ok(TensorMap(map.assume_init()))
        }
    }

    /// `out [m, n] = act(x [m, k] · w [n, k]ᵀ + bias [n])` on `dev`'s stream, where `act` is
    /// `quick_gelu`, `gelu_erf` or none (the bias alone), at device addresses.
    ///
    /// # Safety
    /// `x`, `w`, `bias` (if non-zero) and `out` must be live, 16-byte aligned device buffers
    /// of `dtype` holding [m, k], [n, k], [n] and [m, n] values, in use by nothing else on
    /// another stream, and [`super::covers`] must hold for the shape.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        dev: &candle_core::CudaDevice,
        act: Option<&str>,
        dtype: DType,
        (x, w, bias, out): (u64, u64, u64, u64),
        m: usize,
        n: usize,
        k: usize,
    ) -> candle_core::Result<()> {
        let (suffix, data) = match dtype {
            DType::BF16 => ("bf16", sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
            DType::F16 => ("f16", sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
            other => candle_core::bail!("gemm_wgmma: unsupported dtype {other:?}"),
        };
        let (map_x, map_w) = (tensor_map(x, m, k, data)?, tensor_map(w, n, k, data)?);
        let stem = match act {
            None => "bias",
            Some(a @ ("quick_gelu" | "gelu_erf")) => a,
            Some(other) => candle_core::bail!("gemm_wgmma: no epilogue for {other}"),
        };
        let func = crate::launch::kernel!(MODULE, dev, &format!("gemm_{stem}_{suffix}"))?;
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        func.set_attribute(attr, SHARED as i32).w()?;
        let sms = crate::device_caps::sm_count(dev);
        let tiles = m.div_ceil(128) * (n / 128);
        let cfg = LaunchConfig {
            grid_dim: (tiles.min(sms) as u32, 1, 1),
            block_dim: (384, 1, 1),
            shared_mem_bytes: SHARED as u32,
        };
        let (m, n, k) = (m as i32, n as i32, k as i32);
        let func = func.into_cuda_function();
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&map_x).arg(&map_w).arg(&bias).arg(&out).arg(&m).arg(&n).arg(&k);
        // SAFETY: the caller's contract: the maps describe x and w, the kernel reads them
        // and the bias and writes the [m, n] rows of out, all of whose tiles it covers.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}
