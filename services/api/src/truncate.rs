//! Cutting a prompt that is too long, before anything is reserved for it: vLLM's
//! per-request `truncate_prompt_tokens` (keep the last k tokens) and LightLLM's
//! `--long-truncation-mode` (`head`: drop tokens from the start; `center`: from the
//! middle) for prompts past the context. A media item's tokens are never split: an item
//! wholly inside the dropped part goes with it, a cut that would fall inside one is
//! refused.

/// Where a too-long prompt loses tokens (`--long-truncation-mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TruncationMode {
    /// Refuse it (400).
    #[default]
    None,
    /// Drop tokens from the start.
    Head,
    /// Drop tokens from the middle, keeping the start and the end.
    Center,
}

/// `ids`, one `placeholder` per media item (of `item_tokens[i]` tokens each, in order),
/// cut to at most `keep` tokens, items at their size: the ids kept and the indexes of the
/// items kept. `Err` says which item a cut would split.
pub fn truncate(
    ids: &[u32],
    placeholder: u32,
    item_tokens: &[u32],
    keep: usize,
    mode: TruncationMode,
) -> Result<(Vec<u32>, Vec<usize>), String> {
    let mut items = item_tokens.iter();
    // (id, its tokens, its item index)
    let mut units = Vec::with_capacity(ids.len());
    let mut item = 0;
    for &id in ids {
        if id == placeholder {
            let n = *items.next().ok_or("more placeholders than items")? as usize;
            units.push((id, n, Some(item)));
            item += 1;
        } else {
            units.push((id, 1, None));
        }
    }
    let total: usize = units.iter().map(|u| u.1).sum();
    if total <= keep {
        return Ok((ids.to_vec(), (0..item).collect()));
    }
    // Tokens in [from, to) go.
    let (from, to) = match mode {
        TruncationMode::None | TruncationMode::Head => (0, total - keep),
        TruncationMode::Center => (keep / 2, total - (keep - keep / 2)),
    };
    let (mut kept, mut kept_items, mut at) = (Vec::new(), Vec::new(), 0usize);
    for (id, n, index) in units {
        let (start, end) = (at, at + n);
        at = end;
        if end <= from || start >= to {
            kept.push(id);
            kept_items.extend(index);
        } else if start < from || end > to {
            let i = index.unwrap_or_default();
            return Err(format!(
                "cutting the prompt to {keep} tokens would split media item {i} (its {n} tokens are at {start}..{end}, the cut at {from}..{to}): send a shorter prompt, fewer items, or let more tokens stay"
            ));
        }
    }
    Ok((kept, kept_items))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u32 = 9;

    #[test]
    fn keeps_what_fits_and_cuts_the_head_or_the_middle() {
        let ids = [1, 2, P, 3, 4, 5];
        // 1 2 [P P P] 3 4 5: 8 tokens.
        assert_eq!(truncate(&ids, P, &[3], 8, TruncationMode::Head).unwrap(), (ids.to_vec(), vec![0]));
        assert_eq!(truncate(&ids, P, &[3], 3, TruncationMode::Head).unwrap(), (vec![3, 4, 5], vec![]));
        assert_eq!(truncate(&ids, P, &[3], 6, TruncationMode::Head).unwrap(), (vec![P, 3, 4, 5], vec![0]));
        assert_eq!(truncate(&ids, P, &[3], 2, TruncationMode::Center).unwrap(), (vec![1, 5], vec![]));
        assert_eq!(truncate(&ids, P, &[3], 5, TruncationMode::Center).unwrap(), (vec![1, 2, 3, 4, 5], vec![]));
        // 1 2 3 4 [P P]: the middle is text.
        assert_eq!(truncate(&[1, 2, 3, 4, P], P, &[2], 4, TruncationMode::Center).unwrap(), (vec![1, 2, P], vec![0]));
    }

    #[test]
    fn never_splits_an_item() {
        let ids = [1, 2, P, 3, 4, 5];
        let e = truncate(&ids, P, &[3], 5, TruncationMode::Head).unwrap_err();
        assert!(e.contains("media item 0"), "{e}");
        assert!(truncate(&ids, P, &[3], 6, TruncationMode::Center).is_err());
    }

    #[test]
    fn counts_every_item_at_its_size() {
        let ids = [P, 1, P, 2];
        assert_eq!(truncate(&ids, P, &[4, 2], 3, TruncationMode::Head).unwrap(), (vec![P, 2], vec![1]));
        assert!(truncate(&[P], P, &[], 1, TruncationMode::Head).is_err());
    }
}
