//! `x·Wᵀ + b (+ r)` as one cuBLASLt GEMM on the GPU, for 16-bit models: the bias and the
//! residual `r` ride in the GEMM's epilogue (the bias as `CUBLASLT_EPILOGUE_BIAS`, the
//! residual as C with β = 1, written to a fresh D), where the encoders used to run the GEMM,
//! then a pass for the bias, then a pass for the residual add: at CLIP-L's batch of 32
//! images each such pass moved 40–300 MB per layer.
//!
//! The values differ from the separate passes by rounding only: the bias and the residual
//! are added to the f32 accumulator before the one rounding to the output dtype.
//! [`self_test`] checks it against the CPU's f32 result. The algorithm is chosen once per
//! shape and cached: cuBLASLt's heuristic's first pick, or for large shapes the fastest of
//! its first few, timed (`choose`).

use candle_core::{DType, Device, Tensor};

use crate::{Kernels, OpError};

/// Fewest rows of x worth an epilogue GEMM: below it (decode steps) the per-call descriptor
/// setup is not repaid, and the skinny kernel or cuBLAS take the rows.
const MIN_ROWS: usize = 32;

/// `x [M, K] · w [N, K]ᵀ + bias [N] (+ residual [M, N])` through cuBLASLt, when it applies
/// (GPU, bf16 or f16, contiguous, at least [`MIN_ROWS`] rows); else `None`.
pub fn linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    kernels: &Kernels,
) -> candle_core::Result<Option<Tensor>> {
    gemm(x, w, bias, residual, None, kernels)
}

/// `act(x·Wᵀ + b)` where `act` is one of `kernels/fused.cu`'s activations by its name stem
/// (`quick_gelu`, `gelu_erf`), when the GEMM applies as for [`linear`]: the GEMM, then the
/// activation in place over its output (no second buffer). Running the GEMM in L2-sized
/// row chunks, each activated while still in L2, was measured slower at every chunk size
/// (CLIP-L at 32 images on the H100: 25.3-26.2 ms against 24.6): the chunks' partial last
/// waves cost more than the HBM round trip saved.
pub fn linear_act(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    act: &'static str,
    kernels: &Kernels,
) -> candle_core::Result<Option<Tensor>> {
    gemm(x, w, bias, None, Some(act), kernels)
}

fn gemm(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    act: Option<&'static str>,
    kernels: &Kernels,
) -> candle_core::Result<Option<Tensor>> {
    let (m, _) = x.dims2()?;
    let applies = x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && m >= MIN_ROWS
        && (bias.is_some() || residual.is_some() || act.is_some());
    if !applies {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let residual = residual.map(|r| r.contiguous()).transpose()?;
        // cuBLASLt's heuristic assumes 256-byte aligned operands (its default preference);
        // a view that starts elsewhere takes the plain path instead.
        let aligned = |t: &Tensor| (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(256);
        if ![Some(&x), Some(&w), bias, residual.as_ref()].into_iter().flatten().all(aligned) {
            return Ok(None);
        }
        let (k, n) = (x.dim(1)?, w.dim(0)?);
        let ours =
            kernels.gemm_wgmma && act.is_some() && residual.is_none() && crate::gemm_wgmma::covers(x.device(), m, n, k);
        let op = cuda::Epilogue { bias, residual: residual.as_ref(), act, ours, tune: kernels.gemm_tune_candidates };
        Ok(Some(x.apply_op2_no_bwd(&w, &op)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (w, residual, act, kernels);
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::HashMap;
    use std::ffi::c_void;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Mutex, MutexGuard};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cublaslt::{result, sys};
    use candle_core::cuda_backend::cudarc::driver::sys as memset;
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
    use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

    /// The op over (x, w); the bias and the residual come with it, and the activation run
    /// in place after the GEMM.
    pub(super) struct Epilogue<'a> {
        pub(super) bias: Option<&'a Tensor>,
        pub(super) residual: Option<&'a Tensor>,
        pub(super) act: Option<&'static str>,
        /// `gemm_wgmma.rs`'s kernel takes it (bias and activation in its epilogue).
        pub(super) ours: bool,
        /// cuBLASLt candidates timed for a new shape of many rows.
        pub(super) tune: usize,
    }

    /// cuBLASLt's workspace on Hopper (NVIDIA's recommendation).
    const WORKSPACE: usize = 32 << 20;

    /// Rows from which a new shape's algorithm is timed rather than taken on the heuristic's
    /// word: the encoders' batches (577 rows an image) and long prefills, where the
    /// heuristic's first pick ran CLIP-L's output projection at half the matmul peak and a
    /// few milliseconds of timing, once per shape, are repaid within a few batches.
    const TUNE_ROWS: usize = 4096;
    /// Launches timed of each candidate (after one untimed).
    const TUNE_RUNS: usize = 3;
    /// Shapes timed at most in a process: a server's prefill chunks come in many row counts,
    /// and each timing stalls its step for a few dozen GEMMs; the encoders' batch shapes
    /// (577 rows an image) come first and are few.
    const TUNE_SHAPES: usize = 32;
    static TUNED: AtomicUsize = AtomicUsize::new(0);
    /// Set by the self-test: outputs start as NaN (all ones), so that a value the kernels
    /// leave unwritten shows.
    pub(super) static POISON: AtomicBool = AtomicBool::new(false);

    /// The process's cuBLASLt handle, workspace and chosen algorithms (one GPU per process).
    struct Lt {
        handle: sys::cublasLtHandle_t,
        workspace: CudaSlice<u8>,
        algos: HashMap<(usize, usize, usize, DType, bool, bool), sys::cublasLtMatmulAlgo_t>,
    }

    // SAFETY: the handle is only used under the mutex below, one call at a time; cuBLASLt
    // handles may be used from any host thread.
    unsafe impl Send for Lt {}

    /// Made on first use, under the lock, so that racing first calls cannot make two.
    static LT: Mutex<Option<Lt>> = Mutex::new(None);

    fn lt(dev: &candle_core::CudaDevice) -> candle_core::Result<MutexGuard<'static, Option<Lt>>> {
        let mut guard = LT.lock().map_err(|_| candle_core::Error::Msg("cuBLASLt lock poisoned".into()))?;
        if guard.is_none() {
            let workspace = dev.cuda_stream().alloc_zeros::<u8>(WORKSPACE).map_err(candle_core::Error::wrap)?;
            let handle = result::create_handle().map_err(candle_core::Error::wrap)?;
            *guard = Some(Lt { handle, workspace, algos: HashMap::new() });
        }
        Ok(guard)
    }

    /// Descriptors of one call, destroyed on drop.
    struct Descs {
        desc: sys::cublasLtMatmulDesc_t,
        layouts: [sys::cublasLtMatrixLayout_t; 3],
    }

    impl Drop for Descs {
        fn drop(&mut self) {
            // SAFETY: created in `describe`, destroyed once here.
            unsafe {
                let _ = result::destroy_matmul_desc(self.desc);
                for l in self.layouts {
                    let _ = result::destroy_matrix_layout(l);
                }
            }
        }
    }

    fn set_desc<V>(
        desc: sys::cublasLtMatmulDesc_t,
        attr: sys::cublasLtMatmulDescAttributes_t,
        v: &V,
    ) -> candle_core::Result<()> {
        // SAFETY: `v` is the attribute's documented type and lives through the call.
        unsafe { result::set_matmul_desc_attribute(desc, attr, v as *const V as *const c_void, size_of::<V>()) }
            .map_err(candle_core::Error::wrap)
    }

    /// Row-major `y [M, N] = x [M, K] · w [N, K]ᵀ` is column-major `yᵀ (N×M) = w (K×N)ᵀ ·
    /// xᵀ (K×M)`: A = w transposed, B = x, C = D = y, all with their row length as leading dim.
    fn describe(dtype: DType, m: usize, n: usize, k: usize, bias: Option<u64>) -> candle_core::Result<Descs> {
        let ty = match dtype {
            DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
            _ => sys::cudaDataType_t::CUDA_R_16F,
        };
        let wrap = candle_core::Error::wrap;
        let desc =
            result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F)
                .map_err(wrap)?;
        let a = result::create_matrix_layout(ty, k as u64, n as u64, k as i64).map_err(wrap)?;
        let b = result::create_matrix_layout(ty, k as u64, m as u64, k as i64).map_err(wrap)?;
        let c = result::create_matrix_layout(ty, n as u64, m as u64, n as i64).map_err(wrap)?;
        let descs = Descs { desc, layouts: [a, b, c] };
        use sys::cublasLtMatmulDescAttributes_t as A;
        // cublasOperation_t: 0 = N, 1 = T.
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
        if let Some(ptr) = bias {
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS)?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr)?;
        }
        Ok(descs)
    }

    /// cuBLASLt's heuristic's first `count` algorithms for the call `descs` describes.
    fn candidates(
        handle: sys::cublasLtHandle_t,
        descs: &Descs,
        count: usize,
    ) -> candle_core::Result<Vec<sys::cublasLtMatmulAlgo_t>> {
        let wrap = candle_core::Error::wrap;
        let pref = result::create_matmul_pref().map_err(wrap)?;
        let size = WORKSPACE as u64;
        let [a, b, c] = descs.layouts;
        let mut found: Vec<sys::cublasLtMatmulHeuristicResult_t> = Vec::with_capacity(count);
        let mut n = 0i32;
        // SAFETY: `pref` and the descriptors are live; the attribute is a u64 byte count;
        // `found` has room for `count` results, of which the call fills the first `n`.
        let status = unsafe {
            let set = result::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &size as *const u64 as *const c_void,
                size_of::<u64>(),
            );
            let got = set.and_then(|_| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    descs.desc,
                    a,
                    b,
                    c,
                    c,
                    pref,
                    count as i32,
                    found.as_mut_ptr(),
                    &mut n,
                )
                .result()
            });
            let _ = result::destroy_matmul_pref(pref);
            if got.is_ok() {
                found.set_len((n.max(0) as usize).min(count));
            }
            got
        };
        status.map_err(wrap)?;
        let algos: Vec<_> =
            found.iter().filter(|f| f.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).map(|f| f.algo).collect();
        if algos.is_empty() {
            candle_core::bail!("gemm_epilogue: cuBLASLt has no algorithm for this GEMM");
        }
        Ok(algos)
    }

    /// The algorithm for a new shape: the heuristic's first, or from `TUNE_ROWS` rows the
    /// fastest of its first `count`, each timed on the call's own operands (the outputs are
    /// rewritten by the real launch after).
    fn choose(
        handle: sys::cublasLtHandle_t,
        descs: &Descs,
        (rows, count): (usize, usize),
        stream: &CudaStream,
        launch: &dyn Fn(&sys::cublasLtMatmulAlgo_t) -> candle_core::Result<()>,
    ) -> candle_core::Result<sys::cublasLtMatmulAlgo_t> {
        let tune = rows >= TUNE_ROWS && count > 1 && TUNED.fetch_add(1, Ordering::Relaxed) < TUNE_SHAPES;
        let algos = candidates(handle, descs, if tune { count } else { 1 })?;
        if algos.len() == 1 {
            return Ok(algos[0]);
        }
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = (f32::INFINITY, algos[0]);
        for algo in algos {
            // The warm-up also weeds out an algorithm that refuses these operands.
            if launch(&algo).is_err() {
                continue;
            }
            let start = stream.record_event(timing).map_err(candle_core::Error::wrap)?;
            for _ in 0..TUNE_RUNS {
                launch(&algo)?;
            }
            let end = stream.record_event(timing).map_err(candle_core::Error::wrap)?;
            let ms = start.elapsed_ms(&end).map_err(candle_core::Error::wrap)?;
            if ms < best.0 {
                best = (ms, algo);
            }
        }
        Ok(best.1)
    }

    impl CustomOp2 for Epilogue<'_> {
        fn name(&self) -> &'static str {
            "gemm_epilogue"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("gemm_epilogue runs on the GPU only")
        }

        fn cuda_fwd(
            &self,
            x: &candle_core::CudaStorage,
            lx: &Layout,
            w: &candle_core::CudaStorage,
            lw: &Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
            let (m, k) = lx.shape().dims2()?;
            let (n, kw) = lw.shape().dims2()?;
            let bias_fits =
                self.bias.is_none_or(|b| b.elem_count() == n && b.is_contiguous() && b.dtype() == x.dtype());
            let res_fits =
                self.residual.is_none_or(|r| r.dims() == [m, n] && r.is_contiguous() && r.dtype() == x.dtype());
            if k != kw
                || !lx.is_contiguous()
                || !lw.is_contiguous()
                || !bias_fits
                || !res_fits
                || x.dtype() != w.dtype()
            {
                candle_core::bail!(
                    "gemm_epilogue: x {:?}, w {:?} with their bias and residual do not fit",
                    lx.shape(),
                    lw.shape()
                );
            }
            let dev = x.device().clone();
            let stream = dev.cuda_stream();
            let dtype = x.dtype();
            // Read guards on the bias's and the residual's storage, held through the call.
            let guards = [self.bias, self.residual].map(|t| t.map(|t| t.storage_and_layout()));
            let mut parts = [None, None];
            for (part, guard) in parts.iter_mut().zip(&guards) {
                if let Some((s, l)) = guard {
                    let candle_core::Storage::Cuda(s) = &**s else {
                        candle_core::bail!("gemm_epilogue: bias or residual not on the GPU")
                    };
                    *part = Some((s, l.start_offset()));
                }
            }
            let [bias, residual] = parts;
            macro_rules! run {
                ($t:ty) => {{
                    let x = crate::launch::view::<$t>(x, lx)?;
                    let w = crate::launch::view::<$t>(w, lw)?;
                    // SAFETY: the GEMM writes all of D ([M, N]).
                    let mut out = unsafe { dev.alloc::<$t>(m * n)? };
                    let bias_view = match bias {
                        Some((s, o)) => Some(s.as_cuda_slice::<$t>()?.slice(o..)),
                        None => None,
                    };
                    let res_view = match residual {
                        Some((s, o)) => Some(s.as_cuda_slice::<$t>()?.slice(o..)),
                        None => None,
                    };
                    let (xp, _rx) = x.device_ptr(&stream);
                    let (wp, _rw) = w.device_ptr(&stream);
                    let (op, _ro) = out.device_ptr_mut(&stream);
                    if POISON.load(Ordering::Relaxed) {
                        // SAFETY: out holds m · n values of this size, on this stream.
                        unsafe {
                            memset::cuMemsetD8Async(op, 0xFF, m * n * size_of::<$t>(), stream.cu_stream())
                                .result()
                                .map_err(candle_core::Error::wrap)?
                        };
                    }
                    let bp = bias_view.as_ref().map(|b| b.device_ptr(&stream));
                    let rp = res_view.as_ref().map(|r| r.device_ptr(&stream));
                    if self.ours {
                        let bias_at = bp.as_ref().map_or(0, |b| b.0);
                        // SAFETY: x [m, k], w [n, k], the bias [n] and the fresh out [m, n] are
                        // live on this stream and 256-byte aligned (`gemm` checked both), and
                        // `covers` held for the shape.
                        unsafe { crate::gemm_wgmma::launch(&dev, self.act, dtype, (xp, wp, bias_at, op), m, n, k)? };
                    } else {
                        let mut guard = lt(&dev)?;
                        let Some(Lt { handle, workspace, algos }) = guard.as_mut() else {
                            candle_core::bail!("cuBLASLt handle missing")
                        };
                        let handle = *handle;
                        let (alpha, beta) = (1f32, if rp.is_some() { 1f32 } else { 0f32 });
                        let (ws, _rws) = workspace.device_ptr(&stream);
                        let descs = describe(dtype, m, n, k, bp.as_ref().map(|b| b.0))?;
                        let cc = rp.as_ref().map_or(op, |r| r.0);
                        let [la, lb, lc] = descs.layouts;
                        let launch = |algo: &sys::cublasLtMatmulAlgo_t| {
                            // SAFETY: A, B, C and D point at live device buffers of the shapes
                            // the layouts describe (checked above); D is fresh, C is the residual
                            // or D itself with β = 0 (so a repeated launch writes the same D); all
                            // on this device's stream, which the call joins.
                            unsafe {
                                result::matmul(
                                    handle,
                                    descs.desc,
                                    &alpha as *const f32 as *const c_void,
                                    &beta as *const f32 as *const c_void,
                                    wp as *const c_void,
                                    la,
                                    xp as *const c_void,
                                    lb,
                                    cc as *const c_void,
                                    lc,
                                    op as *mut c_void,
                                    lc,
                                    algo,
                                    ws as *mut c_void,
                                    WORKSPACE,
                                    stream.cu_stream() as sys::cudaStream_t,
                                )
                            }
                            .map_err(candle_core::Error::wrap)
                        };
                        let key = (m, n, k, dtype, bias.is_some(), residual.is_some());
                        let algo = match algos.get(&key) {
                            Some(algo) => *algo,
                            None => {
                                let algo = choose(handle, &descs, (m, self.tune), &stream, &launch)?;
                                algos.insert(key, algo);
                                algo
                            }
                        };
                        launch(&algo)?;
                        if let Some(act) = self.act {
                            crate::fused::activation_in_place(&dev, act, op, m * n, dtype)?;
                        }
                        drop(_rws);
                    }
                    drop((_rx, _rw, _ro, bp, rp));
                    crate::launch::storage(out, &dev)
                }};
            }
            let out = match dtype {
                DType::BF16 => run!(half::bf16),
                DType::F16 => run!(half::f16),
                other => candle_core::bail!("gemm_epilogue: unsupported dtype {other:?}"),
            };
            Ok((out, Shape::from((m, n))))
        }
    }
}

/// While alive, the GEMMs' outputs start poisoned (NaN), so that a value the kernels leave
/// unwritten shows.
#[cfg(feature = "cuda")]
struct Poisoned;

#[cfg(feature = "cuda")]
impl Poisoned {
    fn new() -> Self {
        cuda::POISON.store(true, std::sync::atomic::Ordering::Relaxed);
        Poisoned
    }
}

#[cfg(feature = "cuda")]
impl Drop for Poisoned {
    fn drop(&mut self) {
        cuda::POISON.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Runs the epilogue GEMM on `device` against the CPU's f32 `x·wᵀ + b (+ r)` on random
/// inputs (odd N, with and without each part; outputs poisoned) in bf16 and f16: a line per
/// case whose results differ by more than the output's rounding plus the inputs'.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    if !device.is_cuda() {
        return Ok(bad);
    }
    #[cfg(feature = "cuda")]
    let _poisoned = Poisoned::new();
    // `gemm_wgmma.rs`'s kernel takes the shapes it covers.
    let kernels = &Kernels { gemm_wgmma: true, ..Kernels::default() };
    // The last two are `gemm_wgmma.rs`'s on Hopper (with an activation): several 128×128
    // tiles a CTA, so both consumer groups take turns, a ragged last row tile, and K blocks
    // past the ring's six stages.
    let cases = [(64usize, 72usize, 96usize), (100, 1030, 64), (577, 256, 1024), (4200, 1152, 1024), (8229, 1024, 192)];
    for dtype in [DType::BF16, DType::F16] {
        for (i, &(m, n, k)) in cases.iter().enumerate() {
            let cpu = Device::Cpu;
            let x = Tensor::randn(0f32, 1.0, (m, k), &cpu)?.to_dtype(dtype)?;
            let w = (Tensor::randn(0f32, 1.0, (n, k), &cpu)? / (k as f64).sqrt())?.to_dtype(dtype)?;
            let b = Tensor::randn(0f32, 1.0, n, &cpu)?.to_dtype(dtype)?;
            let r = Tensor::randn(0f32, 1.0, (m, n), &cpu)?.to_dtype(dtype)?;
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            let base = f(&x)?.matmul(&f(&w)?.t()?)?;
            let (xd, wd, bd, rd) =
                (x.to_device(device)?, w.to_device(device)?, b.to_device(device)?, r.to_device(device)?);
            // On Hopper the last two cases must reach our kernel, or they test cuBLASLt twice.
            #[cfg(feature = "cuda")]
            if i >= 3 && crate::device_caps::is_sm90(device) && !crate::gemm_wgmma::covers(device, m, n, k) {
                bad.push(format!("case {i} ({m}×{n}×{k}): gemm_wgmma does not take it"));
            }
            let runs = [
                ("bias", linear(&xd, &wd, Some(&bd), None, kernels)?, base.broadcast_add(&f(&b)?)?),
                ("residual", linear(&xd, &wd, None, Some(&rd), kernels)?, (&base + f(&r)?)?),
                (
                    "bias and residual",
                    linear(&xd, &wd, Some(&bd), Some(&rd), kernels)?,
                    (base.broadcast_add(&f(&b)?)? + f(&r)?)?,
                ),
                ("bias and quick_gelu", linear_act(&xd, &wd, Some(&bd), "quick_gelu", kernels)?, {
                    let y = base.broadcast_add(&f(&b)?)?;
                    (&y * candle_nn::ops::sigmoid(&(&y * 1.702)?)?)?
                }),
                ("quick_gelu", linear_act(&xd, &wd, None, "quick_gelu", kernels)?, {
                    (&base * candle_nn::ops::sigmoid(&(&base * 1.702)?)?)?
                }),
                (
                    "bias and gelu_erf",
                    linear_act(&xd, &wd, Some(&bd), "gelu_erf", kernels)?,
                    base.broadcast_add(&f(&b)?)?.gelu_erf()?,
                ),
            ];
            let ulp = if dtype == DType::F16 { 2f32.powi(-10) } else { 2f32.powi(-7) };
            for (what, got, want) in runs {
                let Some(got) = got else {
                    bad.push(format!("{what} case {i} {dtype:?}: not taken"));
                    continue;
                };
                let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                let want: Vec<f32> = want.flatten_all()?.to_vec1()?;
                // Each output: its own rounding, plus the rounding of the 16-bit inputs.
                let worst = got.iter().zip(&want).fold(0f32, |acc, (a, b)| {
                    let d = (a - b).abs() / (b.abs() + 1.0);
                    if d.is_nan() { f32::INFINITY } else { acc.max(d) }
                });
                // The activation adds its own roundings (transformers' bf16 quick_gelu rounds
                // twice inside) to the GEMM's.
                let allowed = if what.contains("gelu") { 8.0 * ulp } else { 4.0 * ulp };
                if worst > allowed {
                    bad.push(format!("{what} case {i} {dtype:?}: max |Δ|/(|want| + 1) {worst:.3e}"));
                }
            }
        }
    }
    Ok(bad)
}
