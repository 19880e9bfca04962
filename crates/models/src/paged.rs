//! Llama over a paged KV cache: [`PagedKv`] holds, per layer, K and V as
//! `[num_blocks, kv_heads, block_size, head_dim]` tensors (block-major; within a block one
//! KV head's `block_size × head_dim` tile is contiguous, FlashInfer's "HND"), and
//! [`Llama::forward_paged`] runs a batched step whose sequences each name their block
//! table. Token `p` of a sequence lives in block `table[p / block_size]` at row
//! `p % block_size`. The block ids themselves are managed elsewhere (the engine's block
//! manager); this module only reads and writes the slots it is told.
//!
//! A step first writes every new token's K and V into its slot, then each sequence
//! attends over its blocks, gathered by its block table in position order, so the
//! result equals the contiguous path's ([`Llama::forward`]) exactly.

use candle_core::{DType, Device, Tensor};

use crate::ModelError;
use crate::llama::{LayerPools, Llama};
use mmserve_ops::flash_attention::{self, PagedTable};
use mmserve_ops::kv_write::write_kv;
use mmserve_ops::paged_attention::{DecodeTables, paged_decode};

/// The KV pool of one model: per layer, K and V `[num_blocks, kv_heads, block_size, head_dim]`.
pub struct PagedKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    num_blocks: usize,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl PagedKv {
    /// A zeroed pool of `num_blocks` blocks of `block_size` tokens for `model`.
    pub fn new(model: &Llama, num_blocks: usize, block_size: usize, dtype: DType) -> Result<Self, ModelError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(ModelError::InvalidInput(format!(
                "a paged KV cache needs blocks: {num_blocks} blocks of {block_size} tokens"
            )));
        }
        let cfg = model.config();
        let (kv_heads, head_dim) = (cfg.num_key_value_heads, cfg.head_dim);
        let shape = (num_blocks, kv_heads, block_size, head_dim);
        let zeros = |_| Tensor::zeros(shape, dtype, model.device());
        let k = (0..model.num_layers()).map(zeros).collect::<candle_core::Result<Vec<_>>>()?;
        let v = (0..model.num_layers()).map(zeros).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(PagedKv { k, v, num_blocks, block_size, kv_heads, head_dim })
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn dtype(&self) -> DType {
        self.k.first().map_or(DType::F32, |t| t.dtype())
    }

    /// K and V of `layer`: `[num_blocks, kv_heads, block_size, head_dim]`.
    pub fn layer(&self, layer: usize) -> Option<(&Tensor, &Tensor)> {
        Some((self.k.get(layer)?, self.v.get(layer)?))
    }

    /// Copy block `src` into block `dst` in every layer, K and V (copy-on-write).
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), ModelError> {
        let (src, dst) = (src as usize, dst as usize);
        if src >= self.num_blocks || dst >= self.num_blocks {
            return Err(ModelError::InvalidInput(format!(
                "block copy {src} → {dst} outside the pool of {}",
                self.num_blocks
            )));
        }
        if src == dst {
            return Ok(());
        }
        for t in self.k.iter().chain(&self.v) {
            // A copy of the source block first: slice_set refuses a shared storage.
            let block = t.narrow(0, src, 1)?.copy()?;
            t.slice_set(&block, 0, dst)?;
        }
        Ok(())
    }

    /// Writes the new tokens' keys and values `k`, `v` [n, kv_heads, head_dim] of `layer`
    /// at `slots` (see [`slots`](Self::slots)).
    fn write(&self, layer: usize, slots: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<()> {
        let src = |x: &Tensor| x.to_dtype(self.dtype())?.contiguous();
        let err = |e: mmserve_ops::OpError| candle_core::Error::Msg(e.to_string());
        write_kv(&self.k[layer], &src(k)?, slots).map_err(err)?;
        write_kv(&self.v[layer], &src(v)?, slots).map_err(err)
    }

    /// Each new token's slot, `block · block_size + row`, in input order: u32 [n].
    fn slots(&self, seqs: &[PagedSeq<'_>], device: &Device) -> candle_core::Result<Tensor> {
        let bs = self.block_size as u32;
        let slots: Vec<u32> = seqs
            .iter()
            .flat_map(|s| {
                (s.start..s.start + s.new_tokens).map(move |p| s.block_table[p / bs as usize] * bs + p as u32 % bs)
            })
            .collect();
        Tensor::new(slots, device)
    }

    /// The padded block tables and key mask of a step of decodes.
    fn decode_batch(&self, seqs: &[PagedSeq<'_>], device: &Device) -> candle_core::Result<DecodeBatch> {
        let bs = self.block_size;
        let width = seqs.iter().map(|s| (s.start + 1).div_ceil(bs)).max().unwrap_or(1);
        let mut table = Vec::with_capacity(seqs.len() * width);
        let mut mask = Vec::with_capacity(seqs.len() * width * bs);
        for s in seqs {
            let used = (s.start + 1).div_ceil(bs);
            // Padding reads block 0 (any block would do): the mask hides it.
            table.extend(s.block_table[..used].iter().copied().chain(std::iter::repeat_n(0, width - used)));
            mask.extend((0..width * bs).map(|p| if p <= s.start { 0f32 } else { f32::NEG_INFINITY }));
        }
        Ok(DecodeBatch {
            table: Tensor::from_vec(table, seqs.len() * width, device)?,
            mask: Tensor::from_vec(mask, (seqs.len(), 1, 1, width * bs), device)?,
            seqs: seqs.len(),
            width,
        })
    }

    /// Keys and values of every sequence of a decode batch: [B, kv_heads, width · block_size, head_dim].
    fn gather_batch(&self, layer: usize, batch: &DecodeBatch) -> candle_core::Result<(Tensor, Tensor)> {
        let (nkv, bs, hd) = (self.kv_heads, self.block_size, self.head_dim);
        let one = |t: &Tensor| {
            t.index_select(&batch.table, 0)?
                .reshape((batch.seqs, batch.width, nkv, bs, hd))?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((batch.seqs, nkv, batch.width * bs, hd))
        };
        Ok((one(&self.k[layer])?, one(&self.v[layer])?))
    }

    /// Keys and values of one sequence's first `len` tokens: [kv_heads, len, head_dim].
    fn gather(&self, layer: usize, table: &Tensor, len: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let (nkv, hd) = (self.kv_heads, self.head_dim);
        let blocks = table.dim(0)?;
        let one = |t: &Tensor| {
            t.index_select(table, 0)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((nkv, blocks * self.block_size, hd))?
                .narrow(1, 0, len)?
                .contiguous()
        };
        Ok((one(&self.k[layer])?, one(&self.v[layer])?))
    }
}

/// Sequences with at most this many new tokens attend through the decode kernel on the
/// GPU (each query an entry): below it one launch beats a gather and GEMMs per sequence.
const FEW_QUERIES: usize = 32;

/// How a step's short runs of queries attend.
enum DecodeAttention {
    /// In place, through the block tables, one entry per query (the GPU); with the rows
    /// of `q` that are theirs unless every row is.
    InPlace(DecodeTables, Option<Tensor>),
    /// Over gathered, padded blocks (the CPU).
    Gathered(DecodeBatch),
}

/// How a sequence's prefill chunk finds its keys and values.
enum SeqKeys {
    /// Read in place by flash attention through the table (the GPU, 16-bit models).
    Flash(PagedTable),
    /// Gathered from the blocks of this table (on the device), then dense attention.
    Gather(Tensor),
}

/// A step of decodes, batched: block tables padded to `width` blocks ([B · width]) and
/// the mask that hides the padding and the unwritten rows ([B, 1, 1, width · block_size]).
struct DecodeBatch {
    table: Tensor,
    mask: Tensor,
    seqs: usize,
    width: usize,
}

/// One sequence of a paged forward step.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    /// Tokens already in the cache: the new ones take positions `start..start + new_tokens`
    /// (and attend over all earlier positions, read from the blocks).
    pub start: usize,
    /// Rows of the step's `input_embeds` that belong to this sequence (in order).
    pub new_tokens: usize,
    /// The sequence's blocks in position order; must cover `start + new_tokens` tokens.
    pub block_table: &'a [u32],
    /// Qwen-VL's multimodal positions of the sequence (the model must have an
    /// `mrope_section`); `None`: each position is its index.
    pub mrope: Option<&'a MropePositions>,
}

/// One sequence's M-RoPE positions: its prompt's temporal, height and width streams
/// (`mmserve_media::mrope`), and `delta`: position `p` past the prompt is `p + delta` in
/// all three.
#[derive(Debug, Clone, PartialEq)]
pub struct MropePositions {
    pub prompt: [Vec<i64>; 3],
    pub delta: i64,
}

impl MropePositions {
    /// The three position ids of position `p`.
    pub fn at(&self, p: usize) -> [i64; 3] {
        match self.prompt[0].get(p) {
            Some(&t) => [t, self.prompt[1][p], self.prompt[2][p]],
            None => [p as i64 + self.delta; 3],
        }
    }
}

impl Llama {
    /// One forward step over sequences whose new tokens are concatenated along dim 0 of
    /// `input_embeds` [total_new_tokens, hidden], with keys and values in `kv`: writes
    /// each new token's K and V into its slot, and attends (causally, never across
    /// sequences) over the sequence's blocks. Slots of positions `start..` are written
    /// even if the step fails later; the caller counts them only after success.
    ///
    /// Returns f32 logits [total_new_tokens, vocab] if `all_logits`, else each
    /// sequence's last row: [seqs.len(), vocab].
    pub fn forward_paged(
        &self,
        input_embeds: &Tensor,
        seqs: &[PagedSeq<'_>],
        kv: &mut PagedKv,
        all_logits: bool,
    ) -> Result<Tensor, ModelError> {
        let (total, hidden) = input_embeds.dims2()?;
        if hidden != self.config().hidden_size {
            return Err(ModelError::InvalidInput(format!(
                "input_embeds has width {hidden}, the model {}",
                self.config().hidden_size
            )));
        }
        if seqs.is_empty() || seqs.iter().any(|s| s.new_tokens == 0) {
            return Err(ModelError::InvalidInput("every sequence needs a new token".into()));
        }
        if seqs.iter().map(|s| s.new_tokens).sum::<usize>() != total {
            return Err(ModelError::InvalidInput(format!(
                "new_tokens of the sequences do not add up to the {total} input rows"
            )));
        }
        let cfg = self.config();
        if kv.k.len() != self.num_layers() || kv.kv_heads != cfg.num_key_value_heads || kv.head_dim != cfg.head_dim {
            return Err(ModelError::InvalidInput("paged KV cache made for another model".into()));
        }
        for s in seqs {
            let len = s.start.saturating_add(s.new_tokens);
            if s.block_table.len() < len.div_ceil(kv.block_size) {
                return Err(ModelError::InvalidInput(format!(
                    "a block table of {} blocks cannot hold {len} tokens",
                    s.block_table.len()
                )));
            }
            if let Some(&b) = s.block_table.iter().find(|&&b| b as usize >= kv.num_blocks) {
                return Err(ModelError::InvalidInput(format!("block {b} outside the pool of {}", kv.num_blocks)));
            }
        }
        let device = self.device().clone();
        let slots = kv.slots(seqs, &device)?;
        // Prefill chunks on the GPU attend through flash attention over the pool when the
        // kernel covers the model (no gather); otherwise over their gathered blocks. The
        // sequences the decode kernel takes (few new tokens, on the GPU) need no table here:
        // each one made would be an upload per sequence per step.
        let flash = self.flash_attention
            && flash_attention::applies(&device, self.dtype(), cfg.head_dim)
            && kv.dtype() == self.dtype();
        let tables = seqs
            .iter()
            .map(|s| {
                if device.is_cuda() && s.new_tokens <= FEW_QUERIES {
                    return Ok(None);
                }
                let blocks = &s.block_table[..(s.start + s.new_tokens).div_ceil(kv.block_size)];
                Ok(Some(if flash {
                    SeqKeys::Flash(PagedTable::new(blocks, &device)?)
                } else {
                    SeqKeys::Gather(Tensor::new(blocks, &device)?)
                }))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let positions: Vec<usize> = seqs.iter().flat_map(|s| s.start..s.start + s.new_tokens).collect();
        // M-RoPE rows, where any sequence has them: the others' three streams alike.
        let streams = seqs.iter().any(|s| s.mrope.is_some()).then(|| {
            let mut streams: [Vec<i64>; 3] = Default::default();
            for s in seqs {
                for p in s.start..s.start + s.new_tokens {
                    let ids = s.mrope.map_or([p as i64; 3], |m| m.at(p));
                    for (stream, id) in streams.iter_mut().zip(ids) {
                        stream.push(id);
                    }
                }
            }
            streams
        });
        if streams.is_some() && cfg.mrope_section.len() != 3 {
            return Err(ModelError::InvalidInput("M-RoPE positions for a model without mrope_section".into()));
        }
        let rope = match &streams {
            Some(s) => crate::llama::Rope::Multi(s),
            None => crate::llama::Rope::Linear(&positions),
        };
        let lens: Vec<usize> = seqs.iter().map(|s| s.new_tokens).collect();
        let kv = &*kv;
        // On the GPU every query of a sequence with few new tokens (decodes, the tail of a
        // prompt after a prefix-cache hit) attends in place through its block table, all of
        // them in one launch of our kernel: query i of a sequence is an entry of its own
        // that sees positions ..= start + i. Longer runs (prefill chunks) attend one
        // sequence at a time over their gathered blocks, where the GEMMs pay. On the CPU a
        // step of decodes only attends in one batch over padded, gathered blocks.
        let all_decodes = seqs.iter().all(|s| s.new_tokens == 1);
        let decodes = if device.is_cuda() && seqs.iter().any(|s| s.new_tokens <= FEW_QUERIES) {
            let mut entries: Vec<(usize, &[u32])> = Vec::new();
            let mut rows: Vec<u32> = Vec::new();
            let mut row = 0u32;
            for s in seqs {
                if s.new_tokens <= FEW_QUERIES {
                    entries.extend((1..=s.new_tokens).map(|i| (s.start + i, s.block_table)));
                    rows.extend(row..row + s.new_tokens as u32);
                }
                row += s.new_tokens as u32;
            }
            // Rows of `q` that the kernel takes, unless it takes them all.
            let rows = (rows.len() < total).then(|| Tensor::new(rows, &device)).transpose()?;
            Some(DecodeAttention::InPlace(DecodeTables::new(&entries, kv.block_size, &device)?, rows))
        } else if all_decodes && seqs.len() > 1 {
            Some(DecodeAttention::Gathered(kv.decode_batch(seqs, &device)?))
        } else {
            None
        };
        // On the GPU the q/k/v projection writes k and v into their slots itself.
        let pools = device.is_cuda().then_some(LayerPools { k: &kv.k, v: &kv.v, slots: &slots });
        let hidden =
            self.run_layers(input_embeds, rope, (!all_logits).then_some(&lens[..]), pools, |layer, attn, q, new| {
                if let Some((k, v)) = new {
                    kv.write(layer, &slots, k, v)?;
                }
                let mut few = None;
                match &decodes {
                    Some(DecodeAttention::InPlace(tables, None)) => {
                        let out = paged_decode(q, &kv.k[layer], &kv.v[layer], tables, attn.scale())?;
                        return out.reshape((total, ()));
                    }
                    Some(DecodeAttention::InPlace(tables, Some(rows))) => {
                        let q = q.index_select(rows, 0)?;
                        let out = paged_decode(&q, &kv.k[layer], &kv.v[layer], tables, attn.scale())?;
                        few = Some(out.reshape((rows.dim(0)?, ()))?);
                    }
                    Some(DecodeAttention::Gathered(batch)) => {
                        let (k, v) = kv.gather_batch(layer, batch)?;
                        let (k, v) = (k.to_dtype(q.dtype())?, v.to_dtype(q.dtype())?);
                        return attn.attend_decodes(q, &k, &v, &batch.mask);
                    }
                    None => {}
                }
                let mut outs = Vec::with_capacity(seqs.len());
                let (mut offset, mut few_offset) = (0, 0);
                for (s, table) in seqs.iter().zip(&tables) {
                    if let Some(few) = few.as_ref().filter(|_| s.new_tokens <= FEW_QUERIES) {
                        outs.push(few.narrow(0, few_offset, s.new_tokens)?);
                        few_offset += s.new_tokens;
                        offset += s.new_tokens;
                        continue;
                    }
                    let q = q.narrow(0, offset, s.new_tokens)?;
                    let Some(table) = table else {
                        candle_core::bail!("a sequence of {} new tokens has no block table", s.new_tokens)
                    };
                    outs.push(match table {
                        SeqKeys::Flash(t) => {
                            flash_attention::paged(&q, &kv.k[layer], &kv.v[layer], t, s.start, attn.scale())?
                        }
                        SeqKeys::Gather(table) => {
                            let (k, v) = kv.gather(layer, table, s.start + s.new_tokens)?;
                            let (k, v) = (k.to_dtype(q.dtype())?, v.to_dtype(q.dtype())?);
                            attn.attend(&q, &k, &v, s.start)?
                        }
                    });
                    offset += s.new_tokens;
                }
                Tensor::cat(&outs, 0)
            })?;
        Ok(candle_core::Module::forward(self.lm_head(), &hidden)?.to_dtype(DType::F32)?)
    }
}
