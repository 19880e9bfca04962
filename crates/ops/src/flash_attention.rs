//! Flash attention on the GPU (`kernels/flash_attention.cu`; Dao et al. 2022,
//! "FlashAttention", FlashAttention-2's loop order): softmax(scale · q·kᵀ)·v with the scores
//! kept in registers, tensor cores for both products, bf16 or f16 with head dims 64 and 128
//! ([`applies`]). Two callers:
//!
//! - the encoders ([`packed`]): q, k and v side by side in the stacked q/k/v GEMM's output
//!   `[B·N, 3·H·hd]`, every query over every key of its item. It replaces the head split,
//!   two batched GEMMs, the softmax over a materialised score matrix and the transpose back.
//! - prefill over the paged pool ([`paged`]): a sequence's new queries over its cached and
//!   new keys, causal, read through its block table with no gather of the blocks.
//! - Qwen-VL's towers ([`varlen`]): one packed sequence of images (or windows) of
//!   different lengths, each row over the keys of its own segment only, with no padding to
//!   the longest and one launch for all.
//!
//! Each op's CPU twin is a plain two-pass softmax in f32, the reference the kernel is tested
//! against ([`self_test`]); the model code calls the ops on the GPU only.

use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Shape, Tensor};

use crate::OpError;
use crate::dispatch::cpu_float;
use crate::elem::FromF32;
#[cfg(feature = "cuda")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::WrapErr;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg, sys};

/// Whether the kernels cover this dtype and head dim on this device (the caller decides
/// whether to take them: `Kernels::flash_attention`).
pub fn applies(device: &Device, dtype: DType, head_dim: usize) -> bool {
    device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16) && matches!(head_dim, 64 | 128)
}

/// [`applies`] for [`varlen`], which also takes Qwen-VL's head dim 80 (1280 / 16): the
/// kernel's loops run over 16-dim steps, so 80 is compiled as such, not padded to 128.
pub fn applies_varlen(device: &Device, dtype: DType, head_dim: usize) -> bool {
    device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16) && matches!(head_dim, 64 | 80 | 128)
}

/// `body` with `T` the element type of a 16-bit float `dtype` and `SUFFIX` its name in
/// the kernels' names; other dtypes are an error.
#[cfg(feature = "cuda")]
macro_rules! by_half {
    ($dtype:expr, |$t:ident, $suffix:ident| $body:expr) => {
        match $dtype {
            DType::BF16 => {
                type $t = half::bf16;
                const $suffix: &str = "bf16";
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                const $suffix: &str = "f16";
                $body
            }
            other => candle_core::bail!("flash attention: unsupported dtype {other:?}"),
        }
    };
}

/// Row tiles of 16 a warp of the mma.sync kernels takes: each K/V fragment feeds twice
/// the MMAs of one tile (one tile a warp lost every A/B and is no longer compiled).
#[cfg(feature = "cuda")]
const ROW_TILES: usize = 2;

/// Which kernel runs the encoders' dense attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// `flash_attention.cu`: mma.sync, warps of [`ROW_TILES`] row tiles of 16.
    Mma,
    /// `flash_wgmma.cu` (compute capability 9.0, head dim 64): warp-group MMAs, CTAs of
    /// two warp groups, a tile's scores overlapping the previous tile's P·V.
    Wgmma,
}

/// The dense kernel for `head_dim` on `device`: the warp-group one where it exists (head
/// dim 64 on compute capability 9.0), else mma.sync.
fn dense_kernel(device: &Device, head_dim: usize) -> Kernel {
    if head_dim == 64 && crate::device_caps::is_sm90(device) { Kernel::Wgmma } else { Kernel::Mma }
}

/// Loads the warp-group kernel and its grid: a CTA (two warp groups) per 128 queries, per
/// head and per batch row.
#[cfg(feature = "cuda")]
fn load_wgmma(
    dev: &candle_core::CudaDevice,
    g: &Geometry,
    suffix: &str,
) -> candle_core::Result<(CudaFunction, LaunchConfig)> {
    const MODULE: crate::launch::Module = crate::launch::module!("flash_wgmma");
    const GROUPS: usize = 2; // FW_GROUPS
    const STAGES: usize = 3; // FW_STAGES
    let rows = 64 * GROUPS;
    let func = crate::launch::kernel!(MODULE, dev, &format!("flash_wgmma_{suffix}"))?;
    // 1024 bytes to align the tiles, the queries, and the K/V ring: 128-byte rows.
    let smem = 1024 + (rows + 2 * STAGES * 64) * 128;
    let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    func.set_attribute(attr, smem as i32).w()?;
    let cfg = LaunchConfig {
        grid_dim: (g.n_q.div_ceil(rows) as u32, g.heads as u32, g.batch as u32),
        block_dim: (128 * GROUPS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    Ok((func.into_cuda_function(), cfg))
}

/// Loads `{name}_{head_dim}`, lets it take the shared memory it needs, and the grid: a CTA
/// per 64 · [`ROW_TILES`] queries, per head and per batch row.
#[cfg(feature = "cuda")]
fn load(dev: &candle_core::CudaDevice, g: &Geometry, name: &str) -> candle_core::Result<(CudaFunction, LaunchConfig)> {
    const MODULE: crate::launch::Module = crate::launch::module!("flash_attention");
    const KEYS: usize = 64; // FA_BC
    const TILES: usize = ROW_TILES;
    if !matches!(g.head_dim, 64 | 80 | 128) {
        candle_core::bail!("flash attention: head dim {} is not compiled", g.head_dim);
    }
    let func = crate::launch::kernel!(MODULE, dev, &format!("{name}_{}", g.head_dim))?;
    // K and V tiles, double-buffered, rows padded by 8; at head dim 128 with two row tiles
    // also the CTA's queries (`QS` in the kernel).
    let queries = if g.head_dim > 64 { 64 * TILES } else { 0 };
    let smem = (2 * 2 * KEYS + queries) * (g.head_dim + 8) * 2;
    let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    func.set_attribute(attr, smem as i32).w()?;
    let cfg = LaunchConfig {
        grid_dim: (g.n_q.div_ceil(64 * TILES) as u32, g.heads as u32, g.batch as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    Ok((func.into_cuda_function(), cfg))
}

/// Queries, keys and outputs of one launch, as the kernel and its twin see them.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    batch: usize,
    n_q: usize,
    n_k: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Causal: query i sees keys `..= past + i`.
    past: Option<usize>,
}

/// The f32 reference: out `[batch, n_q, heads, head_dim]` from row accessors `q(b, i, h)`,
/// `kv(b, j, kv_head)` (the offset of a row of `k` and of `v`).
fn reference<T: FromF32>(
    g: &Geometry,
    q: &[T],
    k: &[T],
    v: &[T],
    q_at: impl Fn(usize, usize, usize) -> usize,
    kv_at: impl Fn(usize, usize, usize) -> usize,
    scale: f32,
) -> Vec<T> {
    let hd = g.head_dim;
    let group = g.heads / g.kv_heads;
    let mut out = Vec::with_capacity(g.batch * g.n_q * g.heads * hd);
    let mut acc = vec![0f32; hd];
    for b in 0..g.batch {
        for i in 0..g.n_q {
            let visible = g.past.map_or(g.n_k, |p| g.n_k.min(p + i + 1));
            for h in 0..g.heads {
                let qrow = &q[q_at(b, i, h)..][..hd];
                let scores: Vec<f32> = (0..visible)
                    .map(|j| {
                        let krow = &k[kv_at(b, j, h / group)..][..hd];
                        scale * qrow.iter().zip(krow).map(|(&a, &c)| a.into() * c.into()).sum::<f32>()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let (mut total, w): (f32, Vec<f32>) = (0.0, scores.iter().map(|s| (s - max).exp()).collect());
                acc.fill(0.0);
                for (j, &wj) in w.iter().enumerate() {
                    total += wj;
                    for (a, &x) in acc.iter_mut().zip(&v[kv_at(b, j, h / group)..][..hd]) {
                        *a += wj * x.into();
                    }
                }
                out.extend(acc.iter().map(|&a| T::from_f32(if total > 0.0 { a / total } else { 0.0 })));
            }
        }
    }
    out
}

/// The encoder's op over `qkv` [B·N, 3·H·hd] → [B·N, H·hd].
struct Packed {
    batch: usize,
    n: usize,
    heads: usize,
    scale: f32,
    /// The kernel on the GPU.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    kernel: Kernel,
}

impl Packed {
    fn geometry(&self, l: &Layout) -> candle_core::Result<Geometry> {
        let (rows, cols) = l.shape().dims2()?;
        let width = cols / 3;
        if rows != self.batch * self.n || cols != 3 * width || self.heads == 0 || !width.is_multiple_of(self.heads) {
            candle_core::bail!(
                "flash packed: qkv {:?} is not [{} · {}, 3 · heads · hd]",
                l.shape(),
                self.batch,
                self.n
            );
        }
        if !l.is_contiguous() {
            candle_core::bail!("flash packed: qkv must be contiguous");
        }
        let head_dim = width / self.heads;
        Ok(Geometry {
            batch: self.batch,
            n_q: self.n,
            n_k: self.n,
            heads: self.heads,
            kv_heads: self.heads,
            head_dim,
            past: None,
        })
    }
}

impl CustomOp1 for Packed {
    fn name(&self) -> &'static str {
        "flash_packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = self.geometry(l)?;
        let (n, width, o) = (g.n_q, g.heads * g.head_dim, l.start_offset());
        let row = |b: usize, i: usize| (b * n + i) * 3 * width;
        let out = cpu_float!("flash_packed", (s) => {
            let s = &s[o..];
            reference(&g, s, &s[width..], &s[2 * width..], |b, i, h| row(b, i) + h * g.head_dim,
                |b, j, h| row(b, j) + h * g.head_dim, self.scale)
        });
        Ok((out, Shape::from((g.batch * n, width))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let g = self.geometry(l)?;
        let width = g.heads * g.head_dim;
        let (q_row, q_batch) = (3 * width as i64, (g.n_q * 3 * width) as i64);
        let (o_row, o_batch) = (width as i64, (g.n_q * width) as i64);
        let dev = s.device().clone();
        let (n, group, past) = (g.n_q as i32, 1i32, -1i32);
        let scale = self.scale * std::f32::consts::LOG2_E;
        let out = by_half!(s.dtype(), |T, SUFFIX| {
            let (func, cfg) = match self.kernel {
                Kernel::Mma => load(&dev, &g, &format!("flash_dense_{SUFFIX}"))?,
                Kernel::Wgmma if g.head_dim == 64 => load_wgmma(&dev, &g, SUFFIX)?,
                Kernel::Wgmma => candle_core::bail!("flash wgmma: head dim {} is not 64", g.head_dim),
            };
            let qkv = crate::launch::view::<T>(s, l)?;
            let (k, v) = (qkv.slice(width..), qkv.slice(2 * width..));
            // SAFETY: the kernel writes every row of every head.
            let mut out = unsafe { dev.alloc::<T>(g.batch * g.n_q * width)? };
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&qkv).arg(&q_batch).arg(&q_row).arg(&k).arg(&v).arg(&q_batch).arg(&q_row);
            b.arg(&mut out).arg(&o_batch).arg(&o_row).arg(&n).arg(&n).arg(&group).arg(&past).arg(&scale);
            // SAFETY: rows `b · N + i < B · N` of qkv at columns below 3 · width are read,
            // rows of out [B · N, width] written; `geometry` checked the shapes.
            unsafe { b.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((g.batch * g.n_q, width))))
    }
}

/// One sequence's block table on the device, checked once for all the layers of a step.
pub struct PagedTable {
    table: Tensor,
    blocks: usize,
    max_block: u32,
}

impl PagedTable {
    pub fn new(blocks: &[u32], device: &Device) -> candle_core::Result<Self> {
        let max_block = blocks.iter().copied().max().unwrap_or(0);
        Ok(PagedTable { table: Tensor::new(blocks, device)?, blocks: blocks.len(), max_block })
    }
}

/// Prefill's op: `q` [n, H, hd] over the pool's `k`, `v` [num_blocks, kv_heads, block_size,
/// hd] through `table`, causal after `past` cached tokens → [n, H · hd].
struct Paged<'a> {
    table: &'a PagedTable,
    past: usize,
    scale: f32,
}

impl Paged<'_> {
    fn geometry(&self, lq: &Layout, lk: &Layout, lv: &Layout) -> candle_core::Result<(Geometry, usize)> {
        let (n_q, heads, head_dim) = lq.shape().dims3()?;
        let (blocks, kv_heads, block_size, kd) = lk.shape().dims4()?;
        if lk.shape() != lv.shape() || kd != head_dim || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            candle_core::bail!("flash paged: q {:?}, k {:?}, v {:?} do not fit", lq.shape(), lk.shape(), lv.shape());
        }
        if !lq.is_contiguous() || !lk.is_contiguous() || !lv.is_contiguous() {
            candle_core::bail!("flash paged needs contiguous tensors");
        }
        let n_k = self.past + n_q;
        if block_size == 0 || self.table.blocks * block_size < n_k || self.table.max_block as usize >= blocks {
            candle_core::bail!(
                "flash paged: a table of {} blocks (largest {}) for {n_k} keys in a pool of {blocks} blocks of {block_size}",
                self.table.blocks,
                self.table.max_block
            );
        }
        let g = Geometry { batch: 1, n_q, n_k, heads, kv_heads, head_dim, past: Some(self.past) };
        Ok((g, block_size))
    }
}

impl CustomOp3 for Paged<'_> {
    fn name(&self) -> &'static str {
        "flash_paged"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (g, bs) = self.geometry(lq, lk, lv)?;
        let table: Vec<u32> = self.table.table.to_vec1()?;
        let hd = g.head_dim;
        let (oq, ok, ov) = (lq.start_offset(), lk.start_offset(), lv.start_offset());
        let kv_at = |_: usize, j: usize, h: usize| ((table[j / bs] as usize * g.kv_heads + h) * bs + j % bs) * hd;
        let out = cpu_float!("flash_paged", (q, k, v) => reference(&g, &q[oq..], &k[ok..], &v[ov..],
            |_, i, h| (i * g.heads + h) * hd, kv_at, self.scale));
        Ok((out, Shape::from((g.n_q, g.heads * hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (g, bs) = self.geometry(lq, lk, lv)?;
        let (ts, tl) = self.table.table.storage_and_layout();
        let candle_core::Storage::Cuda(ts) = &*ts else {
            candle_core::bail!("flash paged: the table is not on the GPU")
        };
        let table = crate::launch::view::<u32>(ts, tl)?;
        let dev = q.device().clone();
        let row = (g.heads * g.head_dim) as i64;
        let (bs, kvh, n_q, n_k) = (bs as i32, g.kv_heads as i32, g.n_q as i32, g.n_k as i32);
        let (group, past) = ((g.heads / g.kv_heads) as i32, self.past as i32);
        let scale = self.scale * std::f32::consts::LOG2_E;
        let out = by_half!(q.dtype(), |T, SUFFIX| {
            let (func, cfg) = load(&dev, &g, &format!("flash_paged_{SUFFIX}"))?;
            let q = crate::launch::view::<T>(q, lq)?;
            let k = crate::launch::view::<T>(k, lk)?;
            let v = crate::launch::view::<T>(v, lv)?;
            // SAFETY: the kernel writes every row of every head.
            let mut out = unsafe { dev.alloc::<T>(g.n_q * g.heads * g.head_dim)? };
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&q).arg(&row).arg(&k).arg(&v).arg(&table).arg(&bs).arg(&kvh).arg(&mut out).arg(&row);
            b.arg(&n_q).arg(&n_k).arg(&group).arg(&past).arg(&scale);
            // SAFETY: q [n, H, hd] and out [n, H · hd] are read and written within their
            // rows; the pool is read only in the blocks the table names for keys < n_k, which
            // `geometry` checked against the pool and the table's length.
            unsafe { b.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((g.n_q, g.heads * g.head_dim))))
    }
}

/// The segments of a packed sequence on the device: segment i is rows
/// `starts[i]..starts[i + 1]`. Made once per forward, used by every layer.
pub struct Segments {
    /// The kernel's view: [segments + 1] i32 on the device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    starts: Tensor,
    lens: Vec<usize>,
}

impl Segments {
    /// From the segments' lengths, in order; empty ones are dropped (they hold no rows).
    pub fn new(lens: &[usize], device: &Device) -> candle_core::Result<Self> {
        let lens: Vec<usize> = lens.iter().copied().filter(|&n| n > 0).collect();
        let mut starts = Vec::with_capacity(lens.len() + 1);
        let mut at = 0usize;
        starts.push(0i32);
        for &n in &lens {
            at += n;
            starts.push(
                i32::try_from(at).map_err(|_| candle_core::Error::Msg(format!("{at} rows in a packed sequence")))?,
            );
        }
        Ok(Segments { starts: Tensor::new(starts.as_slice(), device)?, lens })
    }

    /// Rows in all segments.
    pub fn rows(&self) -> usize {
        self.lens.iter().sum()
    }
}

/// The towers' op: `q` [n, H, hd], `k`, `v` [n, K, hd] in segments → [n, H · hd], each row
/// over the keys of its segment.
struct Varlen<'a> {
    segments: &'a Segments,
    scale: f32,
}

impl Varlen<'_> {
    fn geometry(&self, lq: &Layout, lk: &Layout, lv: &Layout) -> candle_core::Result<Geometry> {
        let (n, heads, head_dim) = lq.shape().dims3()?;
        let (nk, kv_heads, kd) = lk.shape().dims3()?;
        if lk.shape() != lv.shape() || nk != n || kd != head_dim || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            candle_core::bail!("flash varlen: q {:?}, k {:?}, v {:?} do not fit", lq.shape(), lk.shape(), lv.shape());
        }
        if !lq.is_contiguous() || !lk.is_contiguous() || !lv.is_contiguous() {
            candle_core::bail!("flash varlen needs contiguous tensors");
        }
        if self.segments.rows() != n {
            candle_core::bail!("flash varlen: segments of {} rows for {n} rows", self.segments.rows());
        }
        let longest = self.segments.lens.iter().copied().max().unwrap_or(0);
        Ok(Geometry {
            batch: self.segments.lens.len(),
            n_q: longest,
            n_k: longest,
            heads,
            kv_heads,
            head_dim,
            past: None,
        })
    }
}

impl CustomOp3 for Varlen<'_> {
    fn name(&self) -> &'static str {
        "flash_varlen"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = self.geometry(lq, lk, lv)?;
        let (hd, n) = (g.head_dim, self.segments.rows());
        let (oq, ok, ov) = (lq.start_offset(), lk.start_offset(), lv.start_offset());
        let out = cpu_float!("flash_varlen", (q, k, v) => {
            let (q, k, v) = (&q[oq..], &k[ok..], &v[ov..]);
            let mut out = Vec::with_capacity(n * g.heads * hd);
            let mut first = 0;
            for &len in &self.segments.lens {
                let seg = Geometry { batch: 1, n_q: len, n_k: len, ..g };
                out.extend(reference(&seg, q, k, v, |_, i, h| ((first + i) * g.heads + h) * hd,
                    |_, j, h| ((first + j) * g.kv_heads + h) * hd, self.scale));
                first += len;
            }
            out
        });
        Ok((out, Shape::from((n, g.heads * hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let g = self.geometry(lq, lk, lv)?;
        let n = self.segments.rows();
        let (ss, sl) = self.segments.starts.storage_and_layout();
        let candle_core::Storage::Cuda(ss) = &*ss else {
            candle_core::bail!("flash varlen: the segments are not on the GPU")
        };
        let starts = crate::launch::view::<i32>(ss, sl)?;
        let dev = q.device().clone();
        let (q_row, kv_row) = ((g.heads * g.head_dim) as i64, (g.kv_heads * g.head_dim) as i64);
        let group = (g.heads / g.kv_heads) as i32;
        let scale = self.scale * std::f32::consts::LOG2_E;
        let out = by_half!(q.dtype(), |T, SUFFIX| {
            let (func, cfg) = load(&dev, &g, &format!("flash_varlen_{SUFFIX}"))?;
            let q = crate::launch::view::<T>(q, lq)?;
            let k = crate::launch::view::<T>(k, lk)?;
            let v = crate::launch::view::<T>(v, lv)?;
            // SAFETY: the kernel writes every row of every head (each row is in a segment).
            let mut out = unsafe { dev.alloc::<T>(n * g.heads * g.head_dim)? };
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&q).arg(&q_row).arg(&k).arg(&v).arg(&kv_row).arg(&mut out).arg(&q_row);
            b.arg(&starts).arg(&group).arg(&scale);
            // SAFETY: segment b's rows starts[b]..starts[b + 1] lie within the n rows of q, k,
            // v and out (`geometry` checked that the segments cover exactly n rows); a CTA
            // past its segment's end returns before touching memory.
            unsafe { b.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((n, g.heads * g.head_dim))))
    }
}

/// Attention within segments of one packed sequence: `q` [n, H, hd], `k`, `v` [n, K, hd]
/// (K dividing H) → [n, H · hd], no row seeing another segment's keys.
pub fn varlen(q: &Tensor, k: &Tensor, v: &Tensor, segments: &Segments, scale: f32) -> candle_core::Result<Tensor> {
    q.contiguous()?.apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &Varlen { segments, scale })
}

/// `softmax(scale · q·kᵀ)·v` of the encoder: `qkv` [B·N, 3·H·hd] (q, k and v side by side)
/// → [B·N, H·hd], every query over every key of its item.
pub fn packed(qkv: &Tensor, batch: usize, n: usize, heads: usize, scale: f32) -> candle_core::Result<Tensor> {
    let kernel = dense_kernel(qkv.device(), qkv.dim(1)? / 3 / heads.max(1));
    qkv.apply_op1_no_bwd(&Packed { batch, n, heads, scale, kernel })
}

/// Prefill attention of one sequence: `q` [n, H, hd] at positions `past..past + n` over the
/// pool's `k`, `v` [num_blocks, kv_heads, block_size, hd] through `table` → [n, H · hd].
pub fn paged(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &PagedTable,
    past: usize,
    scale: f32,
) -> candle_core::Result<Tensor> {
    q.contiguous()?.apply_op3_no_bwd(k, v, &Paged { table, past, scale })
}

/// Runs both ops on `device` against their CPU twins on random inputs (odd lengths, the
/// last query tile nearly empty, grouped heads, a shuffled block table, cached tokens
/// before the new ones) in bf16 and f16: a line per case whose results differ by more than
/// the output's rounding. Blocks outside the table and the slots past the last key hold
/// NaN, so a read of either shows.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    let mut seed = 0x5EED_F1A5_u64;
    let mut uniform = move |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 11) as f32 / (1u64 << 53) as f32 * 4.0 - 2.0
            })
            .collect()
    };
    for dtype in [DType::BF16, DType::F16] {
        // (batch, n, heads, head_dim); 577: CLIP-L/336's tokens, 9 full tiles of keys and one
        // key more, and a last query tile of one row. At head dim 64 the last tile of keys
        // holds 13, 5, 1, 16 and 17 keys: the warp-group kernel's narrow step takes the
        // first four (a tile of at most 16), its masked full step the last.
        let cases =
            [(2, 77, 3, 64), (1, 130, 2, 128), (3, 5, 1, 64), (2, 577, 2, 64), (1, 144, 2, 64), (1, 145, 1, 64)];
        for (i, &(batch, n, heads, hd)) in cases.iter().enumerate() {
            let x = uniform(batch * n * 3 * heads * hd);
            let run = |dev: &Device, kernel: Kernel| -> Result<Vec<f32>, OpError> {
                let qkv = Tensor::from_slice(&x, (batch * n, 3 * heads * hd), dev)?.to_dtype(dtype)?;
                let op = Packed { batch, n, heads, scale: (hd as f32).powf(-0.5), kernel };
                Ok(qkv.apply_op1_no_bwd(&op)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
            };
            let want = run(&Device::Cpu, Kernel::Mma)?;
            let mut kernels = vec![Kernel::Mma];
            if hd == 64 && crate::device_caps::is_sm90(device) {
                kernels.push(Kernel::Wgmma);
            }
            for kernel in kernels {
                if let Some(line) = judge(&run(device, kernel)?, &want, dtype) {
                    bad.push(format!("packed case {i} {dtype:?} {kernel:?}: {line}"));
                }
            }
        }
        // Segments (one of a single row, one of a tile and a row, one spanning several
        // tiles of keys) at Qwen-VL's head dim 80 and at 64 with grouped heads. A row that
        // strayed into a neighbour's keys would change the result.
        let cases: [(&[usize], usize, usize, usize); 3] =
            [(&[77, 1, 130, 64], 2, 2, 80), (&[200, 3], 4, 2, 64), (&[5, 129], 1, 1, 128)];
        for (i, &(lens, heads, kv_heads, hd)) in cases.iter().enumerate() {
            let n: usize = lens.iter().sum();
            let (q, k, v) = (uniform(n * heads * hd), uniform(n * kv_heads * hd), uniform(n * kv_heads * hd));
            let run = |dev: &Device| -> Result<Vec<f32>, OpError> {
                let t = |x: &[f32], h: usize| -> Result<Tensor, OpError> {
                    Ok(Tensor::from_slice(x, (n, h, hd), dev)?.to_dtype(dtype)?)
                };
                let segments = Segments::new(lens, dev)?;
                let out =
                    varlen(&t(&q, heads)?, &t(&k, kv_heads)?, &t(&v, kv_heads)?, &segments, (hd as f32).powf(-0.5))?;
                Ok(out.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
            };
            let want = run(&Device::Cpu)?;
            if let Some(line) = judge(&run(device)?, &want, dtype) {
                bad.push(format!("varlen case {i} {dtype:?}: {line}"));
            }
        }
        // (new queries, cached tokens, heads, kv heads, head_dim, block_size)
        // The last: Qwen2-7B's seven query heads a KV head.
        let cases: [(usize, usize, usize, usize, usize, usize); 5] = [
            (70, 0, 4, 2, 128, 16),
            (33, 100, 2, 1, 64, 16),
            (130, 5, 4, 4, 128, 32),
            (1, 20, 2, 2, 64, 16),
            (77, 40, 14, 2, 128, 16),
        ];
        for (i, &(n, past, heads, kv_heads, hd, bs)) in cases.iter().enumerate() {
            let used = (past + n).div_ceil(bs);
            // Block 0 and the last block are in no table; the table runs backwards.
            let blocks = used + 2;
            let table: Vec<u32> = (1..=used as u32).rev().collect();
            let pool_len = blocks * kv_heads * bs * hd;
            let poison = |mut v: Vec<f32>| {
                let block = kv_heads * bs * hd;
                v[..block].fill(f32::NAN);
                v[(blocks - 1) * block..].fill(f32::NAN);
                // Slots of the last used block past the last key.
                let (last, fill) = (table[used - 1] as usize, (past + n) - (used - 1) * bs);
                for h in 0..kv_heads {
                    let at = (last * kv_heads + h) * bs;
                    v[(at + fill) * hd..(at + bs) * hd].fill(f32::NAN);
                }
                v
            };
            let (q, k, v) = (uniform(n * heads * hd), poison(uniform(pool_len)), poison(uniform(pool_len)));
            let run = |dev: &Device| -> Result<Vec<f32>, OpError> {
                let pool = |x: &[f32]| -> Result<Tensor, OpError> {
                    Ok(Tensor::from_slice(x, (blocks, kv_heads, bs, hd), dev)?.to_dtype(dtype)?)
                };
                let q = Tensor::from_slice(&q, (n, heads, hd), dev)?.to_dtype(dtype)?;
                let table = PagedTable::new(&table, dev)?;
                let op = Paged { table: &table, past, scale: (hd as f32).powf(-0.5) };
                let out = q.apply_op3_no_bwd(&pool(&k)?, &pool(&v)?, &op)?;
                Ok(out.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
            };
            let want = run(&Device::Cpu)?;
            if let Some(line) = judge(&run(device)?, &want, dtype) {
                bad.push(format!("paged case {i} {dtype:?}: {line}"));
            }
        }
    }
    Ok(bad)
}

/// `Some(why)` when `got` is off `want` by more than 2 units of the dtype's last place at
/// the largest output (or 1), the products' inputs being rounded to it.
fn judge(got: &[f32], want: &[f32], dtype: DType) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} values, expected {}", got.len(), want.len()));
    }
    let largest = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = got.iter().zip(want).fold(0f32, |m, (a, b)| {
        let d = (a - b).abs();
        if d.is_nan() { f32::INFINITY } else { m.max(d) }
    });
    let ulp = if dtype == DType::F16 { 2f32.powi(-10) } else { 2f32.powi(-7) };
    let tol = 2.0 * ulp * largest.max(1.0);
    (worst > tol).then(|| format!("max |Δ| {worst:.3e} > {tol:.3e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packed twin against candle's softmax(q·kᵀ·scale)·v, head by head.
    #[test]
    fn packed_twin_matches_candle() {
        let dev = Device::Cpu;
        let (b, n, h, d) = (2, 5, 3, 4);
        let qkv = Tensor::randn(0f32, 1.0, (b * n, 3 * h * d), &dev).unwrap();
        let got = packed(&qkv, b, n, h, 0.5).unwrap();
        let part = |i: usize| {
            qkv.narrow(1, i * h * d, h * d)
                .unwrap()
                .reshape((b, n, h, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let scores = (part(0).matmul(&part(1).t().unwrap()).unwrap() * 0.5).unwrap();
        let probs = candle_nn::ops::softmax_last_dim(&scores).unwrap();
        let want = probs.matmul(&part(2)).unwrap().transpose(1, 2).unwrap();
        let want = want.reshape((b * n, h * d)).unwrap();
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
    }

    /// The paged twin: causal after the cached tokens, through the table, grouped heads.
    #[test]
    fn paged_twin_is_causal_through_the_table() {
        let dev = Device::Cpu;
        let (blocks, kvh, bs, hd, heads, past, n) = (4, 1, 2, 3, 2, 3, 2);
        let k = Tensor::randn(0f32, 1.0, (blocks, kvh, bs, hd), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (blocks, kvh, bs, hd), &dev).unwrap();
        let q = Tensor::randn(0f32, 1.0, (n, heads, hd), &dev).unwrap();
        let table = [3u32, 0, 2];
        let out = paged(&q, &k, &v, &PagedTable::new(&table, &dev).unwrap(), past, 1.0).unwrap();
        let out: Vec<Vec<f32>> = out.to_vec2().unwrap();
        let row = |x: &Tensor, p: usize| -> Vec<f32> {
            x.get(table[p / bs] as usize).unwrap().get(0).unwrap().get(p % bs).unwrap().to_vec1().unwrap()
        };
        for i in 0..n {
            for h in 0..heads {
                let qv: Vec<f32> = q.get(i).unwrap().get(h).unwrap().to_vec1().unwrap();
                let keys = past + i + 1;
                let s: Vec<f32> =
                    (0..keys).map(|p| row(&k, p).iter().zip(&qv).map(|(a, b)| a * b).sum::<f32>()).collect();
                let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let w: Vec<f32> = s.iter().map(|x| (x - max).exp()).collect();
                let total: f32 = w.iter().sum();
                for d in 0..hd {
                    let want = (0..keys).map(|p| w[p] * row(&v, p)[d]).sum::<f32>() / total;
                    assert!((out[i][h * hd + d] - want).abs() < 1e-5, "query {i} head {h} dim {d}");
                }
            }
        }
    }

    /// The varlen twin equals the packed twin run on each segment alone.
    #[test]
    fn varlen_twin_keeps_segments_apart() {
        let dev = Device::Cpu;
        let (h, d, lens) = (2, 4, [3usize, 5, 1]);
        let n: usize = lens.iter().sum();
        let qkv = Tensor::randn(0f32, 1.0, (n, 3 * h * d), &dev).unwrap();
        let part = |i: usize| qkv.narrow(1, i * h * d, h * d).unwrap().reshape((n, h, d)).unwrap();
        let segments = Segments::new(&[3, 0, 5, 1], &dev).unwrap();
        let got = varlen(&part(0), &part(1), &part(2), &segments, 0.7).unwrap();
        let mut at = 0;
        for len in lens {
            let want = packed(&qkv.narrow(0, at, len).unwrap().contiguous().unwrap(), 1, len, h, 0.7).unwrap();
            let diff = (got.narrow(0, at, len).unwrap() - want).unwrap().abs().unwrap();
            assert!(diff.max_all().unwrap().to_scalar::<f32>().unwrap() < 1e-6, "segment at {at}");
            at += len;
        }
        assert!(varlen(&part(0), &part(1), &part(2), &Segments::new(&[3, 5], &dev).unwrap(), 1.0).is_err());
    }

    #[test]
    fn refuses_a_table_short_of_the_keys_or_outside_the_pool() {
        let dev = Device::Cpu;
        let k = Tensor::zeros((2, 1, 4, 8), DType::F32, &dev).unwrap();
        let q = Tensor::zeros((3, 1, 8), DType::F32, &dev).unwrap();
        assert!(paged(&q, &k, &k, &PagedTable::new(&[0], &dev).unwrap(), 2, 1.0).is_err(), "5 keys, 4 slots");
        assert!(paged(&q, &k, &k, &PagedTable::new(&[0, 2], &dev).unwrap(), 2, 1.0).is_err(), "block 2 of 2");
        assert!(paged(&q, &k, &k, &PagedTable::new(&[1, 0], &dev).unwrap(), 2, 1.0).is_ok());
    }
}
