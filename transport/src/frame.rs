//! The frame header shared by every stream transport: an 8-byte little-endian length.

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 8;

pub(crate) fn encode_header(len: u64) -> [u8; HEADER_LEN] {
    len.to_le_bytes()
}

pub(crate) fn decode_header(bytes: [u8; HEADER_LEN]) -> u64 {
    u64::from_le_bytes(bytes)
}

/// Total length of a frame assembled from `parts`.
pub(crate) fn total_len(parts: &[&[u8]]) -> u64 {
    parts.iter().map(|p| p.len() as u64).sum()
}
