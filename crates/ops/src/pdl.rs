//! Programmatic dependent launch (PDL, compute capability 9.0+): a kernel launched with
//! `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` may start while its stream
//! predecessor still runs, once every CTA of that predecessor has executed
//! `griddepcontrol.launch_dependents` (or exited). A decode step at batch 1 is ~290 short
//! kernels; without PDL each one's launch and ramp-up waits for the previous one's tail,
//! a few µs of idle GPU each time.
//!
//! The contract, which every kernel launched through [`Launch`] keeps (`kernels/pdl.cuh`):
//! before its `pdl_wait()` it reads only memory nothing in the step writes (weights) and
//! writes nothing; after it, the predecessor grid has completed and its writes are visible.
//! Completion is transitive (a grid completes only after its own wait returned), so every
//! earlier kernel of the stream has completed too. Kernels launched the ordinary way
//! (candle's) wait for full completion as always.
//!
//! On devices older than compute capability 9.0 the attribute is left off and the device
//! instructions are no-ops.

use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop, sys,
};

/// The most parameters a kernel launched through [`Launch`] takes.
const MAX_ARGS: usize = 20;

/// Whether launches carry the PDL attribute: on devices of compute capability 9.0 or newer
/// (a 7B decode step at batch 1 went from 4.62 to 4.03 ms with it on the H200).
fn enabled(stream: &CudaStream) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let major = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR;
        stream.context().attribute(major).is_ok_and(|m| m >= 9)
    })
}

/// One kernel launch: its parameters, each held in an 8-byte slot (the driver copies the
/// parameter's own size from the slot's start; little-endian, so a 4-byte value is its
/// first 4 bytes), and the stream-ordering guards of the device buffers it touches (in
/// place, not on the heap: a decode step makes ~290 of these).
pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    slots: [u64; MAX_ARGS],
    guards: [Option<SyncOnDrop<'a>>; MAX_ARGS],
    len: usize,
}

/// A kernel parameter: a device buffer (its address) or a scalar.
pub trait Arg<'a> {
    /// The parameter's bits, and for a device buffer its ordering guard.
    fn bits(self, stream: &'a CudaStream) -> (u64, Option<SyncOnDrop<'a>>);
}

/// Device buffers, read (`device_ptr`) or written (`device_ptr_mut`).
macro_rules! buffer_arg {
    ($($ty:ty => $get:ident),* $(,)?) => {$(
        impl<'a, T> Arg<'a> for $ty {
            fn bits(self, stream: &'a CudaStream) -> (u64, Option<SyncOnDrop<'a>>) {
                let (ptr, guard) = self.$get(stream);
                (ptr, Some(guard))
            }
        }
    )*};
}
buffer_arg!(
    &'a CudaSlice<T> => device_ptr,
    &'a mut CudaSlice<T> => device_ptr_mut,
    &'a CudaView<'_, T> => device_ptr,
    &'a mut CudaViewMut<'_, T> => device_ptr_mut,
);

/// Scalars, widened to a slot.
macro_rules! scalar_arg {
    ($($ty:ty => |$v:ident| $bits:expr),* $(,)?) => {$(
        impl<'a> Arg<'a> for $ty {
            fn bits(self, _: &'a CudaStream) -> (u64, Option<SyncOnDrop<'a>>) {
                let $v = self;
                ($bits, None)
            }
        }
    )*};
}
scalar_arg!(
    i32 => |v| v as u32 as u64,
    u32 => |v| v as u64,
    u64 => |v| v,
    f32 => |v| v.to_bits() as u64,
);

impl<'a> Launch<'a> {
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction) -> Self {
        Self { stream, func, slots: [0; MAX_ARGS], guards: Default::default(), len: 0 }
    }

    /// Appends the next parameter (in the kernel signature's order). Past [`MAX_ARGS`] the
    /// launch fails.
    pub fn arg(&mut self, arg: impl Arg<'a>) -> &mut Self {
        let (bits, guard) = arg.bits(self.stream);
        if let (Some(slot), Some(g)) = (self.slots.get_mut(self.len), self.guards.get_mut(self.len)) {
            *slot = bits;
            *g = guard;
        }
        self.len += 1;
        self
    }

    /// Launches the kernel on the stream, as a programmatic dependent of its predecessor
    /// where [`enabled`].
    ///
    /// # Safety
    /// As cudarc's `LaunchArgs::launch`: the parameters match the kernel's signature in
    /// number, order and size, and the kernel stays inside the buffers it is given. On top
    /// of that the kernel keeps this module's contract (nothing but weights touched before
    /// its `pdl_wait()`).
    pub unsafe fn launch(mut self, cfg: LaunchConfig) -> candle_core::Result<()> {
        if self.len > MAX_ARGS {
            candle_core::bail!("pdl::Launch: {} parameters, at most {MAX_ARGS}", self.len);
        }
        let mut params: [*mut std::ffi::c_void; MAX_ARGS] = [std::ptr::null_mut(); MAX_ARGS];
        for (p, slot) in params.iter_mut().zip(self.slots.iter_mut()) {
            *p = (slot as *mut u64).cast();
        }
        // SAFETY: an all-zero attribute is a valid `CUlaunchAttribute` (plain C data); the
        // union member written is the one the id names.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: enabled(self.stream) as u32,
        };
        self.stream.context().bind_to_thread().w()?;
        // SAFETY: `config` and `attr` outlive the call; `params` holds `len` pointers to
        // live slots, one per kernel parameter (the caller's contract), and the driver
        // copies them before returning. The guards record the launch on drop, after it.
        unsafe { sys::cuLaunchKernelEx(&config, self.func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .w()?;
        drop(self.guards);
        Ok(())
    }
}
