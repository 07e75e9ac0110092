//! `hash_bucket(value [, buckets])`: a stable bucket in `0..buckets`
//! (default 100) of an integer, string or binary value, the same on every
//! server, build and run — so `hash_bucket(id) < 90` and
//! `hash_bucket(id) >= 90` split a dataset into complementary parts.
//!
//! The bucket is `mix(fnv1a64(bytes)) % buckets`, where `bytes` are the
//! value's 8 little-endian bytes as a signed 64-bit integer (every integer
//! type), its UTF-8 bytes (strings) or its bytes (binary), `fnv1a64` is
//! FNV-1a (offset basis 0xcbf29ce484222325, prime 0x100000001b3) and `mix`
//! is SplitMix64's finalizer. A null value has a null bucket (so a filter
//! on it keeps the row on neither side of a split).

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array};
use arrow::datatypes::{DataType, Int64Type};
use datafusion::common::{Result as DfResult, ScalarValue, exec_err, plan_err};
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};

/// Buckets when the call names none.
const DEFAULT_BUCKETS: i64 = 100;

/// FNV-1a over `bytes` from its offset basis (the layout ids' hash).
fn fnv1a64(bytes: &[u8]) -> u64 {
    crate::cluster::fnv1a(bytes, 0xcbf2_9ce4_8422_2325)
}

/// SplitMix64's finalizer: every input bit moves every output bit.
fn mix(mut h: u64) -> u64 {
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The bucket of a string or binary value.
pub fn bucket_of_bytes(bytes: &[u8], buckets: u64) -> u64 {
    mix(fnv1a64(bytes)) % buckets
}

/// The bucket of an integer value.
pub fn bucket_of_int(value: i64, buckets: u64) -> u64 {
    bucket_of_bytes(&value.to_le_bytes(), buckets)
}

/// The `hash_bucket` scalar function.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct HashBucket {
    signature: Signature,
}

impl HashBucket {
    /// The function, ready to register in a session.
    pub fn udf() -> ScalarUDF {
        ScalarUDF::new_from_impl(Self {
            signature: Signature::user_defined(Volatility::Immutable),
        })
    }
}

impl ScalarUDFImpl for HashBucket {
    fn name(&self) -> &str {
        "hash_bucket"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> DfResult<Vec<DataType>> {
        let (value, rest) = match arg_types {
            [value] => (value, None),
            [value, buckets] => (value, Some(buckets)),
            _ => {
                return plan_err!(
                    "hash_bucket takes a value and, optionally, a number of buckets: \
                     hash_bucket(id) or hash_bucket(id, 10)"
                );
            }
        };
        let value = match value {
            t if t.is_integer() => DataType::Int64,
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => DataType::Utf8,
            DataType::Binary | DataType::LargeBinary | DataType::BinaryView => DataType::Binary,
            DataType::Null => DataType::Int64,
            other => {
                return plan_err!(
                    "hash_bucket takes an integer, string or binary value, not {other}"
                );
            }
        };
        match rest {
            None => Ok(vec![value]),
            Some(t) if t.is_integer() => Ok(vec![value, DataType::Int64]),
            Some(t) => plan_err!("hash_bucket's number of buckets must be an integer, not {t}"),
        }
    }

    fn return_type(&self, _arg_types: &[DataType]) -> DfResult<DataType> {
        Ok(DataType::Int64)
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> DfResult<ColumnarValue> {
        let buckets = match args.args.get(1) {
            None => DEFAULT_BUCKETS,
            Some(ColumnarValue::Scalar(ScalarValue::Int64(Some(n)))) if *n >= 1 => *n,
            Some(ColumnarValue::Scalar(s)) => {
                return exec_err!("hash_bucket's number of buckets must be at least 1, not {s}");
            }
            Some(ColumnarValue::Array(_)) => {
                return exec_err!("hash_bucket's number of buckets must be a constant");
            }
        } as u64;
        let n = args.number_rows;
        let Some(value) = args.args.into_iter().next() else {
            return exec_err!("hash_bucket takes a value");
        };
        let values = value.into_array(n)?;
        let out: Int64Array = match values.data_type() {
            DataType::Int64 => values
                .as_primitive::<Int64Type>()
                .iter()
                .map(|v| v.map(|v| bucket_of_int(v, buckets) as i64))
                .collect(),
            DataType::Utf8 => values
                .as_string::<i32>()
                .iter()
                .map(|v| v.map(|v| bucket_of_bytes(v.as_bytes(), buckets) as i64))
                .collect(),
            DataType::Binary => values
                .as_binary::<i32>()
                .iter()
                .map(|v| v.map(|v| bucket_of_bytes(v, buckets) as i64))
                .collect(),
            DataType::Null => Int64Array::new_null(values.len()),
            other => return exec_err!("hash_bucket got {other} values after coercion"),
        };
        Ok(ColumnarValue::Array(Arc::new(out) as ArrayRef))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_stable_and_spread() {
        // Fixed values: a change of the definition would split held-out
        // data differently, so it must show up here.
        assert_eq!(
            bucket_of_int(0, 100),
            bucket_of_bytes(&0i64.to_le_bytes(), 100)
        );
        let mut counts = [0u32; 10];
        for id in 0..10_000i64 {
            counts[bucket_of_int(id, 10) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (900..1100).contains(&c)),
            "{counts:?}"
        );
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
