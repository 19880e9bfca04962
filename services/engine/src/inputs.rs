//! Input embeddings of a prompt: text rows from the embedding table, item rows from
//! the arena, found by virtual token id (`arena[start_index + (id - token_id)]`).

use candle_core::{Device, Tensor};
use mmserve_embed_cache::ArenaView;
use mmserve_models::Llama;
use mmserve_protocol::{EngineError, GenerateRequest, ItemSpan};

/// Where one prompt position's row comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Source {
    Text(u32),
    Slot(u64),
}

/// Checks a request against the model and the arena before it is admitted.
pub fn validate(req: &GenerateRequest, vocab: usize, arena_slots: u64, max_len: usize) -> Result<(), EngineError> {
    if req.prompt_ids.is_empty() {
        return Err(EngineError::Invalid("the prompt is empty".into()));
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

/// Embeddings [ids.len(), hidden] for prompt ids (validated by [`validate`]).
pub fn embed_prompt(model: &Llama, arena: &ArenaView, ids: &[u64], items: &[ItemSpan]) -> Result<Tensor, String> {
    let vocab = model.config().vocab_size;
    let sources: Vec<Source> =
        ids.iter().map(|&id| source(id, vocab, items).map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
    let mut parts = Vec::new();
    let mut i = 0;
    // Consecutive runs of one kind become one tensor each.
    while i < sources.len() {
        let text = matches!(sources[i], Source::Text(_));
        let mut j = i;
        while j < sources.len() && matches!(sources[j], Source::Text(_)) == text {
            j += 1;
        }
        let part = if text {
            let run: Vec<u32> = sources[i..j].iter().map(|s| if let Source::Text(t) = s { *t } else { 0 }).collect();
            model.embed_tokens(&run).map_err(|e| e.to_string())?
        } else {
            let width = arena.row_len();
            let mut rows = vec![0f32; (j - i) * width];
            for (k, s) in sources[i..j].iter().enumerate() {
                let Source::Slot(slot) = *s else { unreachable!("run of slots") };
                arena.read_rows(slot, &mut rows[k * width..(k + 1) * width]).map_err(|e| e.to_string())?;
            }
            Tensor::from_vec(rows, (j - i, width), &Device::Cpu)
                .and_then(|t| t.to_dtype(model.dtype()))
                .and_then(|t| t.to_device(model.device()))
                .map_err(|e| e.to_string())?
        };
        parts.push(part);
        i = j;
    }
    Tensor::cat(&parts, 0).map_err(|e| e.to_string())
}
