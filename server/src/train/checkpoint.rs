//! Checkpoints as safetensors (the format's 8-byte header length, JSON
//! header, then little-endian `F32` data), written and read through
//! `object_store`.
//!
//! A checkpoint holds the parameters (`layers.{l}.weight`, `layers.{l}.bias`),
//! the optimizer state (`optim.m.*`, `optim.v.*`), and in `__metadata__` the
//! global step, the epoch and the sample position within it (samples of the
//! epoch's order already consumed), the model's layer sizes and the
//! optimizer, which a resume checks against its job.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};

/// One named tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: Vec<f32>,
}

/// A checkpoint in memory.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Checkpoint {
    /// Tensors by name.
    pub tensors: BTreeMap<String, Tensor>,
    /// String metadata.
    pub metadata: BTreeMap<String, String>,
}

impl Checkpoint {
    /// The safetensors encoding.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut header = Map::new();
        let mut offset = 0usize;
        for (name, t) in &self.tensors {
            let len = t.data.len() * 4;
            header.insert(
                name.clone(),
                json!({"dtype": "F32", "shape": t.shape, "data_offsets": [offset, offset + len]}),
            );
            offset += len;
        }
        header.insert("__metadata__".into(), json!(self.metadata));
        let mut head = serde_json::to_vec(&Value::Object(header))
            .map_err(|e| Error::Internal(format!("checkpoint header: {e}")))?;
        // Pad the header so the data starts 8-byte aligned.
        while head.len() % 8 != 0 {
            head.push(b' ');
        }
        let mut out = Vec::with_capacity(8 + head.len() + offset);
        out.extend_from_slice(&(head.len() as u64).to_le_bytes());
        out.extend_from_slice(&head);
        for t in self.tensors.values() {
            for v in &t.data {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok(out)
    }

    /// Decodes a safetensors file of `F32` tensors.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |why: &str| Error::invalid(format!("not a flightdeck checkpoint: {why}"));
        let len = bytes
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| bad("shorter than its header"))?;
        let len = usize::try_from(len).map_err(|_| bad("header too large"))?;
        let head = bytes
            .get(8..8usize.saturating_add(len))
            .ok_or_else(|| bad("truncated header"))?;
        let data = &bytes[8 + len..];
        let header: Map<String, Value> =
            serde_json::from_slice(head).map_err(|e| bad(&format!("header is not JSON ({e})")))?;
        let mut out = Checkpoint::default();
        for (name, v) in header {
            if name == "__metadata__" {
                if let Some(m) = v.as_object() {
                    for (k, v) in m {
                        out.metadata
                            .insert(k.clone(), v.as_str().unwrap_or_default().to_string());
                    }
                }
                continue;
            }
            if v.get("dtype").and_then(Value::as_str) != Some("F32") {
                return Err(bad("a tensor is not F32"));
            }
            let sizes = |key: &str| -> Result<Vec<usize>> {
                v.get(key)
                    .and_then(Value::as_array)
                    .ok_or_else(|| bad(&format!("a tensor has no {key}")))?
                    .iter()
                    .map(|d| {
                        d.as_u64()
                            .and_then(|d| usize::try_from(d).ok())
                            .ok_or_else(|| bad(&format!("a tensor has a bad {key}")))
                    })
                    .collect()
            };
            let shape = sizes("shape")?;
            let offs = sizes("data_offsets")?;
            let [start, end] = offs[..] else {
                return Err(bad("data_offsets must have two entries"));
            };
            let len = shape
                .iter()
                .try_fold(4usize, |n, &d| n.checked_mul(d))
                .ok_or_else(|| bad("a tensor's shape is too large"))?;
            let raw = data
                .get(start..end)
                .filter(|r| r.len() == len)
                .ok_or_else(|| bad("a tensor does not fit its data"))?;
            let values = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            out.tensors.insert(
                name,
                Tensor {
                    shape,
                    data: values,
                },
            );
        }
        Ok(out)
    }

    /// A metadata value parsed as a number.
    pub fn meta_u64(&self, key: &str) -> Result<u64> {
        self.metadata
            .get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::invalid(format!("checkpoint has no '{key}' in its metadata")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_garbage() {
        let mut c = Checkpoint::default();
        c.tensors.insert(
            "layers.0.weight".into(),
            Tensor {
                shape: vec![2, 3],
                data: vec![1.0, -2.5, 3.0, 0.0, f32::MIN_POSITIVE, 7.0],
            },
        );
        c.tensors.insert(
            "layers.0.bias".into(),
            Tensor {
                shape: vec![2],
                data: vec![0.5, -0.5],
            },
        );
        c.metadata.insert("step".into(), "42".into());
        let bytes = c.encode().expect("encodes");
        let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        assert_eq!((8 + header_len) % 8, 0, "data is aligned");
        let back = Checkpoint::decode(&bytes).expect("decodes");
        assert_eq!(back, c);
        assert_eq!(back.meta_u64("step").expect("step"), 42);
        assert!(Checkpoint::decode(b"short").is_err());
        assert!(Checkpoint::decode(&bytes[..bytes.len() - 4]).is_err());
        let mut wrong = bytes.clone();
        wrong[8] = b'x';
        assert!(Checkpoint::decode(&wrong).is_err());
    }
}
