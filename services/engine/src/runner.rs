//! The model runner: executes one step's [`Batch`] (the scheduler's plan made concrete)
//! and returns the logits of each sequence's last new position, where the model runs
//! (CPU or CUDA: one implementation, the device is the placement's). The physical KV
//! pool and the mapped arenas live here; the scheduler only hands out block ids.

use std::sync::Arc;

use candle_core::Tensor;
use mmserve_arena::ArenaView;
use mmserve_models::{Llama, MropePositions, PagedKv, PagedSeq};
use mmserve_ops::text_source;
use mmserve_protocol::ItemSpan;

use crate::inputs::{ModelArena, prompt_sources};
use crate::kv::{BlockCopy, BlockId};

/// One sequence's part of a step: positions `start..start + n`.
pub struct BatchSeq<'a> {
    pub prompt_ids: &'a [u64],
    pub items: &'a [ItemSpan],
    pub output: &'a [u32],
    pub start: usize,
    pub n: usize,
    pub block_table: &'a [BlockId],
    /// The sequence's multimodal positions (Qwen-VL), if it has them.
    pub mrope: Option<&'a MropePositions>,
}

/// One model step: the sequences in plan order, and block copies to make first.
pub struct Batch<'a> {
    pub seqs: Vec<BatchSeq<'a>>,
    pub copies: Vec<BlockCopy>,
}

pub trait ModelRunner {
    /// Logits [seqs, vocab] of each sequence's last new position, on the model's device.
    fn forward(&mut self, batch: &Batch<'_>) -> Result<Tensor, String>;
    /// Text ids below this are tokens; media positions are above.
    fn vocab_size(&self) -> usize;
    /// Whether a draw where the logits are saves their copy to the host (a GPU).
    fn samples_on_device(&self) -> bool;
    /// The embed cache instance whose arenas are mapped.
    fn arena_instance(&self) -> u64;
    /// Reads item rows from `view`'s arenas from now on (the cache restarted).
    fn remap(&mut self, view: Arc<ArenaView>) -> Result<(), String>;
}

/// The paged language model.
pub struct LlamaRunner {
    pub model: Llama,
    pub kv: PagedKv,
    pub arena: ModelArena,
}

impl LlamaRunner {
    /// Gather sources of positions `start..start + n` (prompt rows, then output tokens).
    fn sources(&self, s: &BatchSeq<'_>, out: &mut Vec<i64>) -> Result<(), String> {
        let (from, to) = (s.start, s.start + s.n);
        let plen = s.prompt_ids.len();
        if from < plen {
            prompt_sources(&s.prompt_ids[from..to.min(plen)], self.vocab_size(), s.items, out)?;
        }
        if to > plen {
            out.extend(s.output[from.max(plen) - plen..to - plen].iter().map(|&t| text_source(t)));
        }
        Ok(())
    }
}

impl ModelRunner for LlamaRunner {
    fn forward(&mut self, batch: &Batch<'_>) -> Result<Tensor, String> {
        let mut sources = Vec::with_capacity(batch.seqs.iter().map(|s| s.n).sum());
        for s in &batch.seqs {
            self.sources(s, &mut sources)?;
        }
        for copy in &batch.copies {
            self.kv.copy_block(copy.src, copy.dst).map_err(|e| e.to_string())?;
        }
        let seqs: Vec<PagedSeq<'_>> = batch
            .seqs
            .iter()
            .map(|s| PagedSeq { start: s.start, new_tokens: s.n, block_table: s.block_table, mrope: s.mrope })
            .collect();
        let input = self.arena.rows.gather(self.model.embed_table(), &sources).map_err(|e| e.to_string())?;
        self.model.forward_paged(&input, &seqs, &mut self.kv, false).map_err(|e| e.to_string())
    }

    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn samples_on_device(&self) -> bool {
        self.model.device().is_cuda()
    }

    fn arena_instance(&self) -> u64 {
        self.arena.view.info.instance
    }

    fn remap(&mut self, view: Arc<ArenaView>) -> Result<(), String> {
        self.arena = ModelArena::new(view, self.model.device())?;
        Ok(())
    }
}
