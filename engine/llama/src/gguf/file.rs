//! The file: its header, metadata and tensor infos, read with every length, count, offset and
//! size checked against the bytes before anything is read or allocated.

use super::*;

/// A cursor over the file that checks every read against what is left.
pub(super) struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    path: &'a str,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.at
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], CheckpointError> {
        if n > self.left() {
            return Err(bad(
                self.path,
                format!(
                    "{} needs {n} bytes at offset {} but the file has {} left (truncated?)",
                    what(),
                    self.at,
                    self.left()
                ),
            ));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, CheckpointError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, CheckpointError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A count of items of at least `min` bytes each, checked against what is left.
    fn count(&mut self, min: usize, what: &dyn Fn() -> String) -> Result<usize, CheckpointError> {
        let n = self.u64(what)?;
        match usize::try_from(n) {
            Ok(n) if n.checked_mul(min).is_some_and(|b| b <= self.left()) => Ok(n),
            _ => Err(bad(
                self.path,
                format!(
                    "{} says {n} items, more than the {} bytes left can hold",
                    what(),
                    self.left()
                ),
            )),
        }
    }

    fn string(&mut self, max: usize, what: &dyn Fn() -> String) -> Result<String, CheckpointError> {
        let n = self.count(1, what)?;
        if n > max {
            return Err(bad(
                self.path,
                format!("{} is {n} bytes long; at most {max}", what()),
            ));
        }
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| bad(self.path, format!("{} is not UTF-8", what())))
    }

    /// A top-level array under `key`: kept when it is one of [`READ_ARRAYS`] (of a value
    /// type it may hold, and at most [`MAX_TOKENIZER_ENTRIES`] long), else walked and checked
    /// without being kept.
    fn top_array(&mut self, key: &str, what: &dyn Fn() -> String) -> Result<Meta, CheckpointError> {
        let Some((_, kinds)) = READ_ARRAYS.iter().find(|(k, _)| *k == key) else {
            let at = self.at;
            let inner = self.u32(what)?;
            self.at = at;
            let before = self.at;
            self.skip(9, 0, what)?;
            debug_assert!(self.at > before);
            // The element count, read again from the bytes just checked.
            let len = u64::from_le_bytes(self.b[at + 4..at + 12].try_into().expect("8 bytes"));
            return Ok(Meta::Unread {
                kind: inner,
                len: usize::try_from(len).unwrap_or(usize::MAX),
            });
        };
        let at = self.at;
        let inner = self.u32(what)?;
        if !kinds.contains(&inner) {
            return Err(bad(
                self.path,
                format!(
                    "{} is an array of value type {inner}, not the type it holds",
                    what()
                ),
            ));
        }
        let n = self.u64(what)?;
        if n > MAX_TOKENIZER_ENTRIES as u64 {
            return Err(bad(
                self.path,
                format!(
                    "{} has {n} entries; at most {MAX_TOKENIZER_ENTRIES} are taken",
                    what()
                ),
            ));
        }
        self.at = at;
        self.value(9, 0, what)
    }

    /// An array's head at nesting `depth`: its value type and element count, the count checked
    /// against the bytes left at the least each element of that type takes.
    fn array_head(
        &mut self,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<(u32, usize), CheckpointError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(bad(
                self.path,
                format!("{} nests arrays deeper than {MAX_ARRAY_DEPTH}", what()),
            ));
        }
        let inner = self.u32(what)?;
        let min = match inner {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            other => {
                return Err(bad(
                    self.path,
                    format!("{} is an array of unknown type {other}", what()),
                ));
            }
        };
        Ok((inner, self.count(min, what)?))
    }

    /// Walks a value of type `kind` without keeping it: every length checked against the
    /// bytes left, as [`Self::value`] checks it, and nothing allocated.
    fn skip(
        &mut self,
        kind: u32,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<(), CheckpointError> {
        let fixed = match kind {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        if let Some(n) = fixed {
            if kind == 7 {
                let b = self.take(1, what)?[0];
                if b > 1 {
                    return Err(bad(self.path, format!("{} is a bool of {b}", what())));
                }
            } else {
                self.take(n, what)?;
            }
            return Ok(());
        }
        match kind {
            8 => {
                let n = self.count(1, what)?;
                self.take(n, what)?;
                Ok(())
            }
            9 => {
                let (inner, n) = self.array_head(depth, what)?;
                if inner != 7
                    && let Some(size) = match inner {
                        0 | 1 => Some(1),
                        2 | 3 => Some(2),
                        4..=6 => Some(4),
                        10..=12 => Some(8),
                        _ => None,
                    }
                {
                    // Elements of one fixed size: one bounds check for all.
                    self.take(n * size, what)?;
                    return Ok(());
                }
                for _ in 0..n {
                    self.skip(inner, depth + 1, what)?;
                }
                Ok(())
            }
            other => Err(bad(
                self.path,
                format!("{} has unknown value type {other}", what()),
            )),
        }
    }

    fn value(
        &mut self,
        kind: u32,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<Meta, CheckpointError> {
        Ok(match kind {
            0 => Meta::U(u64::from(self.take(1, what)?[0])),
            1 => Meta::I(i64::from(self.take(1, what)?[0] as i8)),
            2 => {
                let b = self.take(2, what)?;
                Meta::U(u64::from(u16::from_le_bytes([b[0], b[1]])))
            }
            3 => {
                let b = self.take(2, what)?;
                Meta::I(i64::from(i16::from_le_bytes([b[0], b[1]])))
            }
            4 => Meta::U(u64::from(self.u32(what)?)),
            5 => Meta::I(i64::from(self.u32(what)? as i32)),
            6 => Meta::F(f64::from(f32::from_bits(self.u32(what)?))),
            7 => match self.take(1, what)?[0] {
                0 => Meta::Bool(false),
                1 => Meta::Bool(true),
                b => return Err(bad(self.path, format!("{} is a bool of {b}", what()))),
            },
            8 => Meta::Str(self.string(usize::MAX, what)?),
            9 => {
                let (inner, n) = self.array_head(depth, what)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1, what)?);
                }
                Meta::Array(v)
            }
            10 => Meta::U(self.u64(what)?),
            11 => Meta::I(self.u64(what)? as i64),
            12 => Meta::F(f64::from_bits(self.u64(what)?)),
            other => {
                return Err(bad(
                    self.path,
                    format!("{} has unknown value type {other}", what()),
                ));
            }
        })
    }
}

#[allow(clippy::type_complexity)]
pub(super) fn parse(
    b: &[u8],
    path: &str,
) -> Result<(BTreeMap<String, Meta>, Vec<TensorInfo>), CheckpointError> {
    let mut r = Reader { b, at: 0, path };
    let magic = r.u32(&|| "the magic".into())?;
    if magic != MAGIC {
        return Err(bad(path, "not a GGUF file (no GGUF magic)"));
    }
    let version = r.u32(&|| "the version".into())?;
    if !(2..=3).contains(&version) {
        return Err(bad(path, format!("GGUF version {version}: served: 2, 3")));
    }
    // A tensor info takes at least 8 (name) + 4 + 8 + 4 + 8 bytes; a key-value 8 + 4 + 1.
    let n_tensors = r.count(32, &|| "the tensor count".into())?;
    let n_kv = r.count(13, &|| "the metadata count".into())?;
    if n_kv > MAX_KEYS {
        return Err(bad(
            path,
            format!("the metadata count is {n_kv}; at most {MAX_KEYS} keys are taken"),
        ));
    }
    let mut meta = BTreeMap::new();
    for i in 0..n_kv {
        let key = r.string(MAX_NAME, &|| format!("metadata key {i}"))?;
        let what = || format!("metadata {key}");
        let kind = r.u32(&what)?;
        let v = if kind == 9 {
            r.top_array(&key, &what)?
        } else {
            r.value(kind, 0, &what)?
        };
        if meta.insert(key.clone(), v).is_some() {
            return Err(bad(path, format!("metadata {key} appears twice")));
        }
    }
    let align = match meta.get("general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 16 => a as usize,
            _ => {
                return Err(bad(
                    path,
                    format!("general.alignment = {v:?}: must be a power of two up to 65536"),
                ));
            }
        },
    };
    let mut infos = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = r.string(MAX_NAME, &|| format!("tensor name {i}"))?;
        let what = || format!("tensor {name}");
        let nd = r.u32(&what)? as usize;
        if nd == 0 || nd > MAX_DIMS {
            return Err(bad(path, format!("tensor {name}: {nd} dimensions")));
        }
        let mut dims = Vec::with_capacity(nd);
        for _ in 0..nd {
            let d = r.u64(&what)?;
            dims.push(
                usize::try_from(d)
                    .map_err(|_| bad(path, format!("tensor {name}: dimension {d}")))?,
            );
        }
        let kind = GgmlType::of(r.u32(&what)?).map_err(|t| CheckpointError::Dtype {
            name: name.clone(),
            dtype: t.to_string(),
        })?;
        let offset = r.u64(&what)?;
        let count = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|&c| c > 0)
            .ok_or_else(|| {
                bad(
                    path,
                    format!("tensor {name}: dimensions {dims:?} overflow or are zero"),
                )
            })?;
        let (per, bytes) = kind.block();
        if !dims[0].is_multiple_of(per) {
            return Err(bad(
                path,
                format!(
                    "tensor {name}: {} rows of {} values are not whole {} blocks of {per}",
                    count / dims[0],
                    dims[0],
                    kind.name()
                ),
            ));
        }
        let len = (count / per)
            .checked_mul(bytes)
            .ok_or_else(|| bad(path, format!("tensor {name}: size overflows")))?;
        let offset = usize::try_from(offset)
            .ok()
            .filter(|o| o.is_multiple_of(align))
            .ok_or_else(|| {
                bad(
                    path,
                    format!("tensor {name}: offset {offset} is not aligned to {align}"),
                )
            })?;
        infos.push((name, dims, kind, offset, len));
    }
    let data = r.at.div_ceil(align) * align;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(infos.len());
    for (name, dims, kind, offset, len) in infos {
        let start = data.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(len));
        let (Some(start), Some(end)) = (start, end) else {
            return Err(bad(path, format!("tensor {name}: offset overflows")));
        };
        if end > b.len() {
            return Err(bad(
                path,
                format!(
                    "tensor {name} lies at bytes {start}..{end}, past the file's {} (truncated?)",
                    b.len()
                ),
            ));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            kind,
            start,
            len,
        });
    }
    let mut spans: Vec<(usize, usize, &str)> = tensors
        .iter()
        .map(|t| (t.start, t.start + t.len, t.name.as_str()))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(bad(
                path,
                format!("tensors {} and {} overlap", w[0].2, w[1].2),
            ));
        }
    }
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(bad(path, format!("tensor {} appears twice", w[0])));
    }
    Ok((meta, tensors))
}
