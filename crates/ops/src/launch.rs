//! What every launch of our kernels repeats, written once: a kernel module's PTX (compiled
//! by `build.rs` from `kernels/{file}.cu`), loaded once per device and looked up by kernel
//! name; operands as typed device views from their layouts' start offsets; and the output
//! wrapped back into a storage. The launches themselves (grids, arguments, `// SAFETY:`
//! contracts) stay with each op, since they are what differs.

use candle_core::Layout;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};

/// One `kernels/*.cu` file's PTX, under the module name `mmserve_{file}`.
pub(crate) struct Module {
    pub(crate) name: &'static str,
    pub(crate) ptx: &'static str,
}

/// `module!("fused")`: the module of `kernels/fused.cu`.
macro_rules! module {
    ($file:literal) => {
        $crate::launch::Module::new(
            concat!("mmserve_", $file),
            include_str!(concat!(env!("OUT_DIR"), "/", $file, ".ptx")),
        )
    };
}
pub(crate) use module;

impl Module {
    pub(crate) const fn new(name: &'static str, ptx: &'static str) -> Self {
        Module { name, ptx }
    }
}

/// `kernel!(MODULE, dev, "name")`: kernel `name` of a [`Module`] on `dev` (the module is
/// loaded on first use). A macro because candle does not export the function type.
macro_rules! kernel {
    ($module:expr, $dev:expr, $name:expr) => {
        $dev.get_or_load_custom_func($name, $module.name, $module.ptx)
    };
}
pub(crate) use kernel;

/// The elements of `s` from `l`'s start offset on, as `T` (an error if `s` holds another
/// type).
pub(crate) fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> candle_core::Result<CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

/// A kernel's output as a storage of `dev`.
pub(crate) fn storage<T: CudaDType>(out: CudaSlice<T>, dev: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(out, dev.clone())
}
