//! Where weights come from and where they run: `--load-format` (the checkpoint's
//! safetensors, or random weights for benchmarking a real-sized model from its
//! `config.json` alone), `--device` and `--dtype`.

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use mmserve_config::ModelDir;
use mmserve_ops::Kernels;

use crate::ModelError;
use crate::weights::{Weights, parse_dtype};

/// `--load-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// The model directory's safetensors files.
    #[default]
    Safetensors,
    /// Uniform random weights in ±1e-3 made on the device, every tensor the model asks
    /// for (as vLLM's `dummy`): speed measurements of models we cannot download.
    Dummy,
}

impl std::str::FromStr for LoadFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "safetensors" | "auto" => Ok(LoadFormat::Safetensors),
            "dummy" => Ok(LoadFormat::Dummy),
            other => Err(format!("load format {other:?} (safetensors or dummy)")),
        }
    }
}

impl std::fmt::Display for LoadFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LoadFormat::Safetensors => "safetensors",
            LoadFormat::Dummy => "dummy",
        })
    }
}

/// Uniform(−1e-3, 1e-3) tensors of whatever shape is asked for.
struct DummyBackend;

impl SimpleBackend for DummyBackend {
    fn get(&self, s: Shape, _: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        Tensor::rand(-1e-3f32, 1e-3, s, dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("dummy weights need a shape ({name})")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

impl Weights {
    /// The weights of `dir` in `format`, as `dtype` on `device`.
    pub fn load(dir: &ModelDir, format: LoadFormat, device: &Device, dtype: DType) -> Result<Self, ModelError> {
        match format {
            LoadFormat::Safetensors => Weights::open(&dir.weight_files()?, device, dtype),
            LoadFormat::Dummy => {
                let vb = candle_nn::VarBuilder::from_backend(Box::new(DummyBackend), dtype, device.clone());
                Ok(Weights::from_var_builder(vb, true))
            }
        }
    }
}

/// `--device`: `cpu`, `cuda` (GPU 0) or `cuda:N`.
pub fn parse_device(name: &str) -> Result<Device, ModelError> {
    let cuda = match name {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        other => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| ModelError::Unsupported(format!("device {other:?} (cpu, cuda or cuda:N)")))?,
    };
    if !cfg!(feature = "cuda") {
        return Err(ModelError::Unsupported(format!("device {name:?}: this build has no CUDA (feature `cuda`)")));
    }
    let device = Device::new_cuda(cuda)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = &device {
        // SAFETY: every op of ours runs on this device's one stream (candle's), so no
        // buffer needs events to order its uses across streams; tracking would create and
        // destroy two CUDA events per allocation, hundreds per decode step.
        unsafe { dev.disable_event_tracking() };
        keep_freed_memory(dev)?;
    }
    Ok(device)
}

/// Lets the device's default memory pool (where cudarc's stream-ordered allocations come
/// from) keep what is freed instead of returning it to the driver at every
/// synchronisation: the engine synchronises every step and the encoder every batch, and
/// each would otherwise map its buffers anew (hundreds of microseconds for the vision
/// tower's 100 MB activations). Peak use is unchanged; freed memory is reused.
#[cfg(feature = "cuda")]
fn keep_freed_memory(dev: &candle_core::CudaDevice) -> Result<(), ModelError> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(|e| ModelError::Unsupported(format!("binding the CUDA context: {e}")))?;
    let mut pool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: `pool` receives the device's default pool handle, owned by the driver; the
    // attribute's value is a u64 that lives through the call.
    let status = unsafe {
        let got = sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device());
        if got != sys::CUresult::CUDA_SUCCESS {
            got
        } else {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
        }
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(ModelError::Unsupported(format!("keeping freed GPU memory in the pool: {status:?}")));
    }
    Ok(())
}

/// The device when none is named: the first GPU in a CUDA build, else the CPU.
pub fn default_device_name() -> &'static str {
    if cfg!(feature = "cuda") { "cuda" } else { "cpu" }
}

/// Where a model's weights come from and where they run, resolved from the flags.
#[derive(Debug, Clone)]
pub struct Placement {
    pub format: LoadFormat,
    pub device: Device,
    pub dtype: DType,
    /// The kernel choices that are settings, resolved once here.
    pub kernels: Kernels,
}

impl Placement {
    /// The checkpoint's weights in float32 on the CPU (tests and the CPU build's default).
    pub fn cpu() -> Self {
        Placement {
            format: LoadFormat::Safetensors,
            device: Device::Cpu,
            dtype: DType::F32,
            kernels: Kernels::default(),
        }
    }

    /// The weights of `dir` as placed.
    pub fn weights(&self, dir: &ModelDir) -> Result<Weights, ModelError> {
        Ok(Weights::load(dir, self.format, &self.device, self.dtype)?.with_kernels(self.kernels))
    }
}

/// `--device`, `--dtype` and `--load-format` of the processes that run a model (the
/// encoder and the engine; `mmserve serve` passes its own on to both).
#[derive(Debug, Clone, clap::Args)]
pub struct PlacementArgs {
    /// `cpu`, `cuda` or `cuda:N` (default: the first GPU in a CUDA build, else the CPU).
    #[arg(long, env = "MMSERVE_DEVICE")]
    pub device: Option<String>,
    /// `auto` (the checkpoint's dtype on a GPU, float32 on the CPU), `bfloat16`,
    /// `float16` or `float32`.
    #[arg(long, env = "MMSERVE_DTYPE", default_value = "auto")]
    pub dtype: String,
    /// `safetensors`, or `dummy`: random weights from `config.json` (benchmarks of
    /// models that are not on this machine).
    #[arg(long, env = "MMSERVE_LOAD_FORMAT", default_value = "safetensors")]
    pub load_format: LoadFormat,
    #[command(flatten)]
    pub kernels: KernelArgs,
}

/// The kernel choices that are settings (`mmserve_ops::Kernels`; `kernels/README.md`
/// has the measurements behind each default).
#[derive(Debug, Clone, clap::Args)]
pub struct KernelArgs {
    /// Attention by GEMMs and softmax instead of our flash attention kernels (for
    /// comparing the two).
    #[arg(long, env = "MMSERVE_NO_FLASH_ATTENTION")]
    pub no_flash_attention: bool,
    /// On Hopper, linear layers an activation follows run as cuBLASLt's GEMM then the
    /// activation, instead of our GEMM with both in its epilogue.
    #[arg(long, env = "MMSERVE_NO_GEMM_WGMMA")]
    pub no_gemm_wgmma: bool,
    /// cuBLASLt algorithms timed for each new GEMM shape of 4,096 rows or more (0 or 1:
    /// the heuristic's first).
    #[arg(long, env = "MMSERVE_GEMM_TUNE_CANDIDATES", default_value_t = 8)]
    pub gemm_tune_candidates: usize,
}

impl KernelArgs {
    pub fn resolve(&self) -> Kernels {
        Kernels {
            flash_attention: !self.no_flash_attention,
            gemm_wgmma: !self.no_gemm_wgmma,
            gemm_tune_candidates: self.gemm_tune_candidates,
        }
    }
}

impl PlacementArgs {
    /// Opens the device and settles the dtype for the model in `dir`.
    pub fn resolve(&self, dir: &ModelDir) -> Result<Placement, ModelError> {
        let device = parse_device(self.device.as_deref().unwrap_or(default_device_name()))?;
        let dtype = resolve_dtype(&self.dtype, dir.config.dtype(), &device)?;
        Ok(Placement { format: self.load_format, device, dtype, kernels: self.kernels.resolve() })
    }
}

/// `--dtype`: `auto` takes the checkpoint's dtype (`config.json`) on a GPU and float32
/// on the CPU (where half precision is slow and only emulated); otherwise the named one.
pub fn resolve_dtype(name: &str, config_dtype: &str, device: &Device) -> Result<DType, ModelError> {
    match name {
        "auto" if device.is_cpu() => Ok(DType::F32),
        "auto" => parse_dtype(config_dtype),
        other => parse_dtype(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_dtypes() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        assert!(parse_device("gpu").is_err());
        if !cfg!(feature = "cuda") {
            let e = parse_device("cuda:1").unwrap_err().to_string();
            assert!(e.contains("no CUDA"), "{e}");
        }
        assert_eq!(resolve_dtype("auto", "bfloat16", &Device::Cpu).unwrap(), DType::F32);
        assert_eq!(resolve_dtype("float16", "bfloat16", &Device::Cpu).unwrap(), DType::F16);
        assert!(resolve_dtype("int8", "bfloat16", &Device::Cpu).is_err());
    }
}
