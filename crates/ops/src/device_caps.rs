//! What our kernels ask of the GPU they run on, asked once a process (one GPU a process):
//! whether it runs sm_90a code, and how many SMs a persistent or split grid should fill.

use candle_core::Device;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::sys;

/// Whether `device` runs sm_90a code (compute capability exactly 9.0): the warp-group
/// kernels (`flash_wgmma.cu`, `gemm_wgmma.cu`) load there alone.
pub fn is_sm90(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        return *ON.get_or_init(|| {
            let ctx = dev.cuda_stream().context().clone();
            let attr = |a| ctx.attribute(a).ok();
            let (major, minor) = (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            );
            (major, minor) == (Some(9), Some(0))
        });
    }
    let _ = device;
    false
}

/// The SMs of `dev` (132 on the H100 and H200, the guess if the driver will not say).
#[cfg(feature = "cuda")]
pub fn sm_count(dev: &candle_core::CudaDevice) -> usize {
    static SMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SMS.get_or_init(|| {
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        dev.cuda_stream().context().attribute(attr).map_or(132, |n| n as usize)
    })
}
