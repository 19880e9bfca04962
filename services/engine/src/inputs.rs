//! Where a step's input rows come from: text rows of the embedding table, item rows of
//! the arena found by virtual token id (`arena[start_index + (id - token_id)]`). One
//! gather builds the whole step's input (`kernels/merge.cu` on the GPU, reading the
//! arena in place).

use std::sync::Arc;

use candle_core::Device;
use mmserve_arena::ArenaView;
use mmserve_models::parse_dtype;
use mmserve_ops::{ArenaRows, slot_source, text_source};
use mmserve_protocol::{EngineError, GenerateRequest, ItemSpan};

/// Where one prompt position's row comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Source {
    Text(u32),
    Slot(u64),
}

/// Checks a request against the model and the arena before it is admitted (`mrope`:
/// whether the model takes multimodal positions).
pub fn validate(
    req: &GenerateRequest,
    vocab: usize,
    arena_slots: u64,
    max_len: usize,
    mrope: bool,
) -> Result<(), EngineError> {
    if req.prompt_ids.is_empty() {
        return Err(EngineError::Invalid("the prompt is empty".into()));
    }
    if let Some(p) = &req.positions {
        if !mrope {
            return Err(EngineError::Invalid("multimodal positions for a model without M-RoPE".into()));
        }
        if p.streams.iter().any(|s| s.len() != req.prompt_ids.len()) {
            return Err(EngineError::Invalid(format!("positions for {} prompt tokens expected", req.prompt_ids.len())));
        }
    }
    let total = req.prompt_ids.len() as u64 + u64::from(req.params.max_tokens);
    if total > max_len as u64 {
        return Err(EngineError::TooLong {
            prompt: req.prompt_ids.len() as u64,
            max_tokens: u64::from(req.params.max_tokens),
            limit: max_len as u64,
        });
    }
    for span in &req.items {
        if span.start_index + u64::from(span.token_num) > arena_slots {
            return Err(EngineError::Invalid(format!("item at slot {} runs past the arena", span.start_index)));
        }
    }
    for &id in &req.prompt_ids {
        source(id, vocab, &req.items)?;
    }
    Ok(())
}

fn source(id: u64, vocab: usize, items: &[ItemSpan]) -> Result<Source, EngineError> {
    if id < vocab as u64 {
        return Ok(Source::Text(id as u32));
    }
    items
        .iter()
        .find(|s| (s.token_id..s.token_id + u64::from(s.token_num)).contains(&id))
        .map(|s| Source::Slot(s.start_index + (id - s.token_id)))
        .ok_or_else(|| EngineError::Invalid(format!("token id {id} is neither text nor inside a media item")))
}

/// Gather sources ([`mmserve_ops::ArenaRows::gather`]) of prompt ids (validated by
/// [`validate`]): text rows, or item rows found by virtual token id.
pub fn prompt_sources(ids: &[u64], vocab: usize, items: &[ItemSpan], out: &mut Vec<i64>) -> Result<(), String> {
    for &id in ids {
        out.push(match source(id, vocab, items).map_err(|e| e.to_string())? {
            Source::Text(t) => text_source(t),
            Source::Slot(slot) => slot_source(slot),
        });
    }
    Ok(())
}

/// The embed cache's arenas as the model reads them. `rows` is declared first so that
/// it drops (ending the device's registration) before `view` unmaps the memory.
pub struct ModelArena {
    pub rows: ArenaRows,
    pub view: Arc<ArenaView>,
}

impl ModelArena {
    pub fn new(view: Arc<ArenaView>, device: &Device) -> Result<Self, String> {
        let r = view.embed_rows();
        let dtype = parse_dtype(r.dtype.name()).map_err(|e| e.to_string())?;
        // SAFETY: the region is `view`'s mapping, which outlives `rows` (field order).
        let rows = unsafe { ArenaRows::new(r.ptr, r.slots, r.row_len, dtype, device) }.map_err(|e| e.to_string())?;
        if let Some(why) = rows.mapping_error() {
            tracing::warn!(why, "the arena is not mapped for the device; item rows are staged through host memory");
        }
        Ok(ModelArena { rows, view })
    }
}

#[cfg(test)]
mod tests {
    use mmserve_protocol::{MropePrompt, SamplingParams};

    use super::*;

    fn request(positions: Option<MropePrompt>) -> GenerateRequest {
        GenerateRequest {
            request_id: String::new(),
            id: 1,
            client: 1,
            prompt_ids: vec![1, 2, 3],
            items: Vec::new(),
            cache_instance: 0,
            params: SamplingParams { max_tokens: 4, ..Default::default() },
            sibling_of: None,
            positions,
        }
    }

    #[test]
    fn positions_must_fit_the_prompt_and_the_model() {
        let fits = MropePrompt { streams: [vec![0, 1, 2], vec![0, 1, 2], vec![0, 1, 2]], delta: 0 };
        assert!(validate(&request(Some(fits.clone())), 10, 0, 100, true).is_ok());
        assert!(validate(&request(None), 10, 0, 100, true).is_ok(), "text alone: the plain positions");
        let e = validate(&request(Some(fits)), 10, 0, 100, false).unwrap_err();
        assert!(e.to_string().contains("without M-RoPE"), "{e}");
        let short = MropePrompt { streams: [vec![0, 1], vec![0, 1], vec![0, 1]], delta: 0 };
        assert!(validate(&request(Some(short)), 10, 0, 100, true).unwrap_err().to_string().contains("3 prompt tokens"));
    }
}
