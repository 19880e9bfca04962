//! The embedding arena as the models see it: `slots` rows of `width` values of one float
//! dtype in host shared memory (the embed cache owns the layout and hands out the
//! region). On the GPU the region is registered with the device (`cuMemHostRegister`,
//! mapped and portable), which makes it pinned memory the device can address:
//! - the engine's step input ([`ArenaRows::gather`], `kernels/merge.cu`) reads item rows
//!   in place over PCIe, in the same launch that gathers the text rows;
//! - the encoder's copies off the device ([`ArenaRows::write`]) land in the arena at full
//!   bandwidth, with no staging buffer.
//!
//! Where registration fails (a driver or a limit refusing it), the GPU paths stage rows
//! through ordinary memory instead and [`ArenaRows::mapping_error`] says why.

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};

use crate::OpError;
use crate::elem::FromF32;

/// A source in [`ArenaRows::gather`]: a text token's row of the embedding table.
pub fn text_source(token: u32) -> i64 {
    i64::from(token)
}

/// A source in [`ArenaRows::gather`]: an arena slot's row.
pub fn slot_source(slot: u64) -> i64 {
    -(slot as i64) - 1
}

pub struct ArenaRows {
    host: *mut u8,
    slots: usize,
    width: usize,
    dtype: DType,
    /// The region's device address, while registered.
    #[cfg(feature = "cuda")]
    mapped: Option<u64>,
    mapping_error: Option<String>,
}

// SAFETY: the region is shared memory that outlives the value (`new`'s contract); the
// value only reads or writes rows through `&self` methods whose callers own those rows
// for the call (the cache hands each slot to one writer, readers wait for ready).
unsafe impl Send for ArenaRows {}
// SAFETY: as for `Send`: no method mutates the value itself.
unsafe impl Sync for ArenaRows {}

impl std::fmt::Debug for ArenaRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaRows")
            .field("slots", &self.slots)
            .field("width", &self.width)
            .field("dtype", &self.dtype)
            .field("mapped", &self.is_mapped())
            .finish()
    }
}

impl ArenaRows {
    /// The rows at `host`, `slots × width` values of `dtype`, for models on `device`.
    ///
    /// # Safety
    /// `host` must point at a mapping of at least `slots × width × dtype.size_in_bytes()`
    /// bytes that stays mapped for the value's whole life.
    pub unsafe fn new(
        host: *mut u8,
        slots: usize,
        width: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, OpError> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(OpError::InvalidInput(format!("arena rows of {dtype:?}: not a float dtype")));
        }
        #[allow(unused_mut)]
        let mut rows = ArenaRows {
            host,
            slots,
            width,
            dtype,
            #[cfg(feature = "cuda")]
            mapped: None,
            mapping_error: None,
        };
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            match cuda::register(dev, host, slots * width * dtype.size_in_bytes()) {
                Ok(addr) => rows.mapped = Some(addr),
                Err(e) => rows.mapping_error = Some(e),
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        Ok(rows)
    }

    /// Whether the device reads and writes the region in place.
    pub fn is_mapped(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.mapped.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Why a GPU could not register the region (it then stages rows).
    pub fn mapping_error(&self) -> Option<&str> {
        self.mapping_error.as_deref()
    }

    pub fn width(&self) -> usize {
        self.width
    }

    /// The host bytes of rows `slot..slot + n`, checked against the region.
    fn range(&self, slot: usize, n: usize) -> Result<std::ops::Range<usize>, String> {
        match slot.checked_add(n) {
            Some(end) if end <= self.slots => {
                let row = self.width * self.dtype.size_in_bytes();
                Ok(slot * row..end * row)
            }
            _ => Err(format!("arena rows {slot}..+{n} run past its {} slots", self.slots)),
        }
    }

    /// Rows `[sources.len(), width]` in `table`'s dtype and device: row `i` is
    /// `table[s]` for a [`text_source`] `s`, the arena's row for a [`slot_source`].
    pub fn gather(&self, table: &Tensor, sources: &[i64]) -> Result<Tensor, OpError> {
        let (vocab, width) = table.dims2()?;
        if width != self.width {
            return Err(OpError::InvalidInput(format!(
                "arena rows of {} values, embedding rows of {width}",
                self.width
            )));
        }
        for &s in sources {
            let bad = if s >= 0 { s as u64 >= vocab as u64 } else { self.range((-(s + 1)) as usize, 1).is_err() };
            if bad {
                return Err(OpError::InvalidInput(format!("input source {s} is outside the table or the arena")));
            }
        }
        if sources.is_empty() {
            return Ok(Tensor::zeros((0, width), table.dtype(), table.device())?);
        }
        let mut sources = sources.to_vec();
        let mut staged = None;
        if table.device().is_cuda() && !self.is_mapped() {
            let mut slots = Vec::new();
            for s in sources.iter_mut().filter(|s| **s < 0) {
                slots.push((-(*s + 1)) as usize);
                *s = slot_source(slots.len() as u64 - 1);
            }
            staged = Some(self.staged(&slots));
        }
        let src = Tensor::new(sources.as_slice(), table.device())?;
        Ok(table.contiguous()?.apply_op2_no_bwd(&src, &Gather { arena: self, staged })?)
    }

    /// Copies `rows` [n, width] (any float dtype, on the arena's device or the CPU) into
    /// slots `slot..slot + n`, in the arena's dtype. Returns once the bytes are there.
    pub fn write(&self, slot: usize, rows: &Tensor) -> Result<(), OpError> {
        let (n, width) = rows.dims2()?;
        if width != self.width {
            return Err(OpError::InvalidInput(format!("rows of {width} values for an arena of {}", self.width)));
        }
        let range = self.range(slot, n).map_err(OpError::InvalidInput)?;
        let rows = rows.to_dtype(self.dtype)?.contiguous()?;
        // SAFETY: `range` lies inside the region (`new`'s contract, checked above), and
        // the caller owns these slots until it marks them ready.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.host.add(range.start), range.len()) };
        #[cfg(feature = "cuda")]
        if let (Some(_), Device::Cuda(_)) = (self.mapped, rows.device()) {
            return cuda::copy_to_host(&rows, dst);
        }
        let values = rows.to_device(&Device::Cpu)?.flatten_all()?;
        // Straight from the values into the slots, element by element (no byte buffer).
        match self.dtype {
            DType::F32 => put(dst, &values.to_vec1::<f32>()?, |v| v.to_ne_bytes()),
            DType::BF16 => put(dst, &values.to_vec1::<half::bf16>()?, |v| v.to_ne_bytes()),
            _ => put(dst, &values.to_vec1::<half::f16>()?, |v| v.to_ne_bytes()),
        }
        Ok(())
    }

    /// One arena row as `T`, converted through f32 (the CPU twin of the kernel's read).
    fn row_as<T: FromF32>(&self, slot: usize) -> Vec<T> {
        let range = self.range(slot, 1).expect("slot checked by gather");
        // SAFETY: inside the region (checked); the row is ready, so nobody writes it.
        let bytes = unsafe { std::slice::from_raw_parts(self.host.add(range.start), range.len()) };
        match self.dtype {
            DType::F32 => {
                bytes.chunks_exact(4).map(|b| T::from_f32(f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))).collect()
            }
            DType::BF16 => {
                bytes.chunks_exact(2).map(|b| T::from_f32(half::bf16::from_ne_bytes([b[0], b[1]]).to_f32())).collect()
            }
            _ => bytes.chunks_exact(2).map(|b| T::from_f32(half::f16::from_ne_bytes([b[0], b[1]]).to_f32())).collect(),
        }
    }

    /// Rows of the listed slots, packed in order in the arena's dtype: what the device
    /// reads when the region is not mapped.
    fn staged(&self, slots: &[usize]) -> Vec<u8> {
        let mut out = Vec::with_capacity(slots.len() * self.width * self.dtype.size_in_bytes());
        for &slot in slots {
            let range = self.range(slot, 1).expect("slot checked by gather");
            // SAFETY: as in `row_as`.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(self.host.add(range.start), range.len()) });
        }
        out
    }
}

/// `values` into `dst` as native-order bytes (`dst` holds exactly that many).
fn put<T: Copy, const N: usize>(dst: &mut [u8], values: &[T], bytes: impl Fn(T) -> [u8; N]) {
    for (d, &v) in dst.chunks_exact_mut(N).zip(values) {
        d.copy_from_slice(&bytes(v));
    }
}

impl Drop for ArenaRows {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if self.mapped.take().is_some() {
            cuda::unregister(self.host);
        }
    }
}

/// `out[i] = table[src[i]]` or the arena's row `-src[i] - 1` (sources checked by the caller).
struct Gather<'a> {
    arena: &'a ArenaRows,
    /// On a GPU that could not map the arena: the sources' rows in order, which the
    /// (renumbered) slot sources then index.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    staged: Option<Vec<u8>>,
}

fn gather_ref<T: FromF32>(arena: &ArenaRows, table: &[T], src: &[i64], width: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(src.len() * width);
    for &s in src {
        if s >= 0 {
            out.extend_from_slice(&table[s as usize * width..(s as usize + 1) * width]);
        } else {
            out.extend(arena.row_as::<T>((-(s + 1)) as usize));
        }
    }
    out
}

impl CustomOp2 for Gather<'_> {
    fn name(&self) -> &'static str {
        "gather_inputs"
    }

    fn cpu_fwd(
        &self,
        t: &CpuStorage,
        lt: &Layout,
        s: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, width) = lt.shape().dims2()?;
        let CpuStorage::I64(src) = s else { candle_core::bail!("gather_inputs: sources must be i64") };
        let src = &src[ls.start_offset()..][..ls.shape().elem_count()];
        let o = lt.start_offset();
        let out = crate::dispatch::cpu_float!("gather_inputs", (t) => gather_ref(self.arena, &t[o..], src, width));
        Ok((out, Shape::from((src.len(), width))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        t: &candle_core::CudaStorage,
        lt: &Layout,
        s: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::gather(self.arena, self.staged.as_deref(), t, lt, s, ls)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg, sys};
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use candle_core::{DType, Layout, Shape, Tensor};

    use super::ArenaRows;
    use crate::OpError;
    use crate::dispatch::by_float;

    const MODULE: crate::launch::Module = crate::launch::module!("merge");

    /// Pins and maps `len` bytes at `host` for every context; their device address.
    pub(super) fn register(dev: &CudaDevice, host: *mut u8, len: usize) -> Result<u64, String> {
        dev.cuda_stream().context().bind_to_thread().map_err(|e| e.to_string())?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: `host..host + len` is a live mapping (ArenaRows::new's contract); the
        // registration ends in `unregister`, before the mapping may go.
        let r = unsafe { sys::cuMemHostRegister_v2(host.cast(), len, flags) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostRegister of {len} bytes: {r:?}"));
        }
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was registered with DEVICEMAP just above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut addr, host.cast(), 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            unregister(host);
            return Err(format!("cuMemHostGetDevicePointer: {r:?}"));
        }
        Ok(addr)
    }

    pub(super) fn unregister(host: *mut u8) {
        // SAFETY: `host` was registered by `register`; no launch reads it after drop
        // (every gather and write synchronises before returning its result's use).
        unsafe { sys::cuMemHostUnregister(host.cast()) };
    }

    /// Copies device `rows` (contiguous, the arena's dtype) into the registered `dst`.
    pub(super) fn copy_to_host(rows: &Tensor, dst: &mut [u8]) -> Result<(), OpError> {
        let (storage, layout) = rows.storage_and_layout();
        let candle_core::Storage::Cuda(storage) = &*storage else {
            return Err(OpError::InvalidInput("rows are not on the GPU".into()));
        };
        let stream = storage.device().cuda_stream();
        let offset = layout.start_offset();
        let mut copy = || -> candle_core::Result<()> {
            by_float!(rows.dtype(), "arena write", |T, _S| {
                let src = storage.as_cuda_slice::<T>()?.slice(offset..offset + dst.len() / std::mem::size_of::<T>());
                // SAFETY: `dst` is pinned host memory of exactly the slice's bytes; every
                // element of T is a plain value, so writing its bytes is sound.
                let dst = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<T>(), src.len()) };
                stream.memcpy_dtoh(&src, dst).w()
            })
        };
        copy()?;
        stream.synchronize().w()?;
        Ok(())
    }

    pub(super) fn gather(
        arena: &ArenaRows,
        staged: Option<&[u8]>,
        t: &candle_core::CudaStorage,
        lt: &Layout,
        s: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (_, width) = lt.shape().dims2()?;
        let n = ls.shape().elem_count();
        let dev = t.device().clone();
        let src = s.as_cuda_slice::<i64>()?.slice(ls.start_offset()..ls.start_offset() + n);
        let staged = staged.map(|bytes| dev.clone_htod(bytes)).transpose()?;
        let mapped = arena.mapped.unwrap_or(0);
        let a = match arena.dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            _ => "f16",
        };
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let width_arg = width as i32;
        let out = by_float!(t.dtype(), "gather_inputs", |T, SUFFIX| {
            let table = crate::launch::view::<T>(t, lt)?;
            // SAFETY: the kernel writes every element of its n rows.
            let mut out = unsafe { dev.alloc::<T>(n * width)? };
            let func = crate::launch::kernel!(MODULE, dev, &format!("gather_inputs_{SUFFIX}_{a}"))?;
            let mut b = func.builder();
            b.arg(&table);
            match &staged {
                Some(rows) => b.arg(rows),
                None => b.arg(&mapped),
            };
            b.arg(&src).arg(&mut out).arg(&width_arg);
            // SAFETY: every source was checked against the table and the arena (or
            // renumbered into `staged`), so each block reads one whole row in bounds and
            // writes its own row of `out`.
            unsafe { b.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((n, width))))
    }
}

/// Runs the gather and the write on `device` against their CPU twins on random rows
/// (odd sizes; every model dtype against every arena dtype; mapped and, on a GPU, also
/// staged): a line per case that differs. Both sides convert through f32 with one
/// rounding, so results must be equal.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let (slots, width, vocab) = (37usize, 203usize, 50usize);
    let mut bad = Vec::new();
    for arena_dtype in [DType::F32, DType::BF16, DType::F16] {
        let values = Tensor::randn(0f32, 1.0, (slots, width), &Device::Cpu)?.to_dtype(arena_dtype)?;
        let mut host = vec![0u8; slots * width * arena_dtype.size_in_bytes()];
        // SAFETY: `host` outlives both views (dropped at the end of this iteration).
        let cpu = unsafe { ArenaRows::new(host.as_mut_ptr(), slots, width, arena_dtype, &Device::Cpu)? };
        cpu.write(0, &values)?;
        let sources: Vec<i64> = (0..29u64)
            .map(|i| {
                if i % 3 == 0 { text_source((i * 7 % vocab as u64) as u32) } else { slot_source(i * 5 % slots as u64) }
            })
            .chain([slot_source(slots as u64 - 1), text_source(vocab as u32 - 1)])
            .collect();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let table = Tensor::randn(0f32, 1.0, (vocab, width), &Device::Cpu)?.to_dtype(dtype)?;
            let want = cpu.gather(&table, &sources)?;
            // One registration at a time: the driver refuses a second of the same pages.
            // SAFETY: as above.
            let mut dev = unsafe { ArenaRows::new(host.as_mut_ptr(), slots, width, arena_dtype, device)? };
            if device.is_cuda() && !dev.is_mapped() {
                bad.push(format!("arena rows not mapped: {}", dev.mapping_error().unwrap_or("?")));
            }
            let table = table.to_device(device)?;
            let mut modes = vec!["as built"];
            if dev.is_mapped() {
                modes.push("staged");
            }
            for mode in modes {
                if mode == "staged" {
                    unmap(&mut dev);
                }
                if !equal(&dev.gather(&table, &sources)?, &want)? {
                    bad.push(format!("gather {mode} {dtype:?} from {arena_dtype:?}: differs from the CPU"));
                }
            }
            drop(dev);
            // Written from the device, read back through the CPU view.
            let rows = Tensor::randn(0f32, 1.0, (5, width), &Device::Cpu)?.to_dtype(dtype)?;
            // SAFETY: as above; `dev` may have been unmapped, so map afresh.
            let writer = unsafe { ArenaRows::new(host.as_mut_ptr(), slots, width, arena_dtype, device)? };
            writer.write(31, &rows.to_device(device)?)?;
            drop(writer);
            let back = cpu.gather(&rows.zeros_like()?, &(31..36).map(slot_source).collect::<Vec<_>>())?;
            let want = rows.to_dtype(arena_dtype)?.to_dtype(dtype)?;
            if !equal(&back, &want)? {
                bad.push(format!("write {dtype:?} into {arena_dtype:?}: differs from the CPU conversion"));
            }
            cpu.write(0, &values)?;
        }
    }
    Ok(bad)
}

/// Ends `rows`' registration (the self-test's staged case).
fn unmap(rows: &mut ArenaRows) {
    #[cfg(feature = "cuda")]
    if rows.mapped.take().is_some() {
        cuda::unregister(rows.host);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = rows;
}

fn equal(a: &Tensor, b: &Tensor) -> Result<bool, OpError> {
    let a: Vec<f32> = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let b: Vec<f32> = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_gather_reads_text_and_slot_rows() {
        let dev = Device::Cpu;
        let mut host = vec![0u8; 3 * 2 * 4];
        // SAFETY: `host` outlives `rows`.
        let rows = unsafe { ArenaRows::new(host.as_mut_ptr(), 3, 2, DType::F32, &dev).unwrap() };
        rows.write(1, &Tensor::new(&[[5f32, 6.], [7., 8.]], &dev).unwrap()).unwrap();
        let table = Tensor::new(&[[1f32, 2.], [3., 4.]], &dev).unwrap();
        let got = rows.gather(&table, &[text_source(1), slot_source(2), slot_source(1), text_source(0)]).unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap(), vec![vec![3., 4.], vec![7., 8.], vec![5., 6.], vec![1., 2.]]);
        // Out of the table, out of the arena, a write past the end: errors, no reads.
        assert!(rows.gather(&table, &[text_source(2)]).is_err());
        assert!(rows.gather(&table, &[slot_source(3)]).is_err());
        assert!(rows.write(2, &Tensor::zeros((2, 2), DType::F32, &dev).unwrap()).is_err());
    }

    #[test]
    fn a_bf16_arena_rounds_once_on_write_and_converts_exactly_on_read() {
        let dev = Device::Cpu;
        let mut host = vec![0u8; 2 * 3 * 2];
        // SAFETY: `host` outlives `rows`.
        let rows = unsafe { ArenaRows::new(host.as_mut_ptr(), 2, 3, DType::BF16, &dev).unwrap() };
        let values = [[1.0f32 + 1.0 / 512.0, -3.3, 1e-3], [65504.0, 0.1, -0.0]];
        rows.write(0, &Tensor::new(&values, &dev).unwrap()).unwrap();
        let table = Tensor::zeros((1, 3), DType::F32, &dev).unwrap();
        let got = rows.gather(&table, &[slot_source(1), slot_source(0)]).unwrap().to_vec2::<f32>().unwrap();
        let bf = |v: f32| half::bf16::from_f32(v).to_f32();
        let want: Vec<Vec<f32>> = [values[1], values[0]].iter().map(|r| r.iter().map(|&v| bf(v)).collect()).collect();
        assert_eq!(got, want);
        // The model's dtype decides the output's: a bf16 table gets bf16 rows.
        let table = Tensor::zeros((1, 3), DType::BF16, &dev).unwrap();
        assert_eq!(rows.gather(&table, &[slot_source(0)]).unwrap().dtype(), DType::BF16);
    }
}
