//! postcard's primitive encodings, by hand, for codecs that write and parse exactly postcard's
//! bytes without serde's visitors (the pipe's descriptor here, the agent's envelope above):
//! unsigned integers as LEB128 varints, `u8`/`i8` and `bool` and `Option`'s tag as one byte,
//! byte strings, strings and sequences behind a varint length, enum variants by a varint index.
//!
//! Reading trusts nothing: every length is checked against the bytes that remain before
//! anything is taken, and every malformed input is an error, never a panic.

/// Where encoded bytes go: a vector, or a [`Count`] that only measures them (so that a value
/// can be sized, then written into an allocation of exactly its length).
pub trait Sink {
    fn put(&mut self, b: u8);
    fn put_slice(&mut self, s: &[u8]);
}

impl Sink for Vec<u8> {
    #[inline]
    fn put(&mut self, b: u8) {
        self.push(b);
    }

    #[inline]
    fn put_slice(&mut self, s: &[u8]) {
        self.extend_from_slice(s);
    }
}

/// A [`Sink`] that counts the bytes it is given.
#[derive(Debug, Default, Clone, Copy)]
pub struct Count(pub usize);

impl Sink for Count {
    #[inline]
    fn put(&mut self, _: u8) {
        self.0 += 1;
    }

    #[inline]
    fn put_slice(&mut self, s: &[u8]) {
        self.0 += s.len();
    }
}

/// An unsigned integer (any width up to 64 bits) as a varint.
#[inline]
pub fn varint<S: Sink>(out: &mut S, mut v: u64) {
    while v >= 0x80 {
        out.put(v as u8 | 0x80);
        v >>= 7;
    }
    out.put(v as u8);
}

/// A byte string or a string: its length, then its bytes.
#[inline]
pub fn bytes<S: Sink>(out: &mut S, b: &[u8]) {
    varint(out, b.len() as u64);
    out.put_slice(b);
}

/// Why bytes do not parse.
pub type Malformed = &'static str;

/// Parses postcard's primitives from the front of a byte slice.
#[derive(Debug, Clone, Copy)]
pub struct Reader<'a> {
    pub rest: &'a [u8],
}

impl<'a> Reader<'a> {
    #[inline]
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { rest: bytes }
    }

    #[inline]
    pub fn byte(&mut self) -> Result<u8, Malformed> {
        let (&b, rest) = self.rest.split_first().ok_or("frame ends early")?;
        self.rest = rest;
        Ok(b)
    }

    /// A varint of at most `max` bytes whose last byte is at most `last` (postcard's rule:
    /// the value must fit the type).
    #[inline]
    fn varint(&mut self, max: usize, last: u8) -> Result<u64, Malformed> {
        let mut v = 0u64;
        for i in 0..max {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                if i == max - 1 && b > last {
                    return Err("varint overflows");
                }
                return Ok(v);
            }
        }
        Err("varint too long")
    }

    #[inline]
    pub fn u64(&mut self) -> Result<u64, Malformed> {
        self.varint(10, 0x01)
    }

    #[inline]
    pub fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(self.varint(5, 0x0f)? as u32)
    }

    #[inline]
    pub fn u16(&mut self) -> Result<u16, Malformed> {
        Ok(self.varint(3, 0x03)? as u16)
    }

    #[inline]
    pub fn bool(&mut self) -> Result<bool, Malformed> {
        match self.byte()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err("bad bool"),
        }
    }

    /// `Option`'s tag: whether a value follows.
    #[inline]
    pub fn some(&mut self) -> Result<bool, Malformed> {
        match self.byte()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err("bad option tag"),
        }
    }

    /// A length (of a sequence or a byte string): a `usize`, with the limits of this target's
    /// width, as postcard reads it.
    #[inline]
    fn len(&mut self) -> Result<u64, Malformed> {
        if cfg!(target_pointer_width = "64") {
            self.u64()
        } else {
            Ok(u64::from(self.u32()?))
        }
    }

    /// A sequence's length, no more than the bytes left (each entry takes at least one).
    #[inline]
    pub fn count(&mut self) -> Result<usize, Malformed> {
        let n = self.len()?;
        if n > self.rest.len() as u64 {
            return Err("sequence longer than the frame");
        }
        Ok(n as usize)
    }

    /// A byte string, borrowed.
    #[inline]
    pub fn slice(&mut self) -> Result<&'a [u8], Malformed> {
        let n = self.len()?;
        if n > self.rest.len() as u64 {
            return Err("byte string longer than the frame");
        }
        let (head, rest) = self.rest.split_at(n as usize);
        self.rest = rest;
        Ok(head)
    }

    /// A string, borrowed: UTF-8 checked, as postcard does.
    #[inline]
    pub fn str(&mut self) -> Result<&'a str, Malformed> {
        std::str::from_utf8(self.slice()?).map_err(|_| "string is not UTF-8")
    }
}

/// Inputs on which a hand codec must agree with its serde reference (the same value, or both
/// refuse): every prefix and every single-bit flip of each sample, each sample with two bytes
/// of trailing junk, and `junk` pseudo-random inputs of up to 95 bytes, mostly small bytes (so
/// that tags and lengths are often plausible). For the codecs' tests (the agent's among them,
/// hence public).
#[doc(hidden)]
pub fn agreement_inputs(samples: &[Vec<u8>], junk: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for sample in samples {
        for cut in 0..=sample.len() {
            out.push(sample[..cut].to_vec());
        }
        for bit in 0..sample.len() * 8 {
            let mut flipped = sample.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            out.push(flipped);
        }
        let mut longer = sample.clone();
        longer.extend_from_slice(&[0xff, 0]);
        out.push(longer);
    }
    let mut x = 0x1234_5678u32;
    for len in 0..junk {
        out.push(
            (0..len % 96)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    if x & 0x300 == 0 {
                        x as u8
                    } else {
                        (x as u8) & 0x0f
                    }
                })
                .collect(),
        );
    }
    out
}
