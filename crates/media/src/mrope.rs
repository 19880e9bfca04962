//! Qwen-VL's multimodal rotary positions (M-RoPE, transformers' `get_rope_index`): each
//! prompt position has three position ids, temporal, height and width. Text positions
//! count up in all three alike; an image's block of tokens takes its merged patch grid's
//! coordinates, offset by the position after the text before it; text after an image
//! resumes one past the largest id so far. Decoding continues from the prompt's length
//! plus `delta` (the largest id + 1 − the prompt's length), in all three alike.

/// A run of prompt tokens: text, or one image's tokens (its grid in merged patches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Span {
    Text(usize),
    Image { t: usize, h: usize, w: usize },
}

/// The three position streams of the prompt made of `spans`, and its `delta`.
pub fn mrope_positions(spans: &[Span]) -> ([Vec<i64>; 3], i64) {
    let mut pos: [Vec<i64>; 3] = Default::default();
    let mut next = 0i64;
    for span in spans {
        match *span {
            Span::Text(n) => {
                for p in &mut pos {
                    p.extend(next..next + n as i64);
                }
                next += n as i64;
            }
            Span::Image { t, h, w } => {
                let mut largest = next - 1;
                for ti in 0..t {
                    for hi in 0..h {
                        for wi in 0..w {
                            let (a, b, c) = (next + ti as i64, next + hi as i64, next + wi as i64);
                            pos[0].push(a);
                            pos[1].push(b);
                            pos[2].push(c);
                            largest = largest.max(a).max(b).max(c);
                        }
                    }
                }
                next = largest + 1;
            }
        }
    }
    let len = pos[0].len() as i64;
    (pos, next - len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_takes_its_grid_and_text_resumes_after_the_largest() {
        let (p, delta) = mrope_positions(&[Span::Text(2), Span::Image { t: 1, h: 2, w: 3 }, Span::Text(2)]);
        assert_eq!(p[0], [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
        assert_eq!(p[1], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]);
        assert_eq!(p[2], [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]);
        assert_eq!(delta, 7 - 10);
        let (p, delta) = mrope_positions(&[Span::Text(4)]);
        assert_eq!((p[1].clone(), delta), (vec![0, 1, 2, 3], 0));
    }
}
