//! How the multi-lane channel cuts a tensor. Both ends compute the same cut from the length and
//! the lane count, so no per-tensor control message is needed.

use std::ops::Range;

/// Pieces smaller than this are not worth a lane of their own.
pub const MIN_PIECE: usize = 256 * 1024;

/// The contiguous piece of a `len`-byte tensor each lane carries (in lane order). Small tensors
/// use fewer lanes; every byte is in exactly one piece.
pub fn pieces(len: usize, lanes: usize) -> Vec<Range<usize>> {
    let used = (len / MIN_PIECE).clamp(1, lanes.max(1));
    (0..used).map(|i| (len * i / used)..(len * (i + 1) / used)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_every_byte_once() {
        for len in [0usize, 1, 100, MIN_PIECE, MIN_PIECE * 3 + 7, 64 << 20] {
            for lanes in 1..6 {
                let p = pieces(len, lanes);
                assert!(!p.is_empty() && p.len() <= lanes);
                assert_eq!(p[0].start, 0);
                assert_eq!(p.last().unwrap().end, len);
                assert!(p.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
        assert_eq!(pieces(64 << 20, 4).len(), 4);
        assert_eq!(pieces(1000, 4).len(), 1);
    }
}
