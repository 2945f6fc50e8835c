//! vLLM's KV-cache event payload (`vllm/distributed/kv_events.py`), byte for byte as msgspec encodes it and
//! as llm-d-kv-cache's vLLM adapter decodes it: a `KVEventBatch` is the positional msgpack array
//! `[ts, events, data_parallel_rank]` (llm-d decodes exactly three elements), and each event is a map
//! tagged under `"type"` (vLLM dropped `array_like` from the events in vllm-project/vllm#42892; llm-d reads
//! both), fields in declaration order, those still at their default (None) left out:
//!
//! ```text
//! {"type": "BlockStored", "block_hashes": [u64], "parent_block_hash": u64 | nil, "token_ids": [u32],
//!  "block_size": n, "lora_id": nil, "medium": "GPU", "lora_name": nil, "extra_keys": [[str] | nil]?}
//! {"type": "BlockRemoved", "block_hashes": [u64], "medium": "GPU"}
//! {"type": "AllBlocksCleared"}
//! ```

use rmp::encode;

use crate::kv::KvEvent;

/// vLLM's `MEDIUM_GPU`: blocks in the shards' KV pool (llm-d's default device tier), whatever the device.
const MEDIUM: &str = "GPU";

/// The msgpack payload of one batch of events, `ts` seconds after the Unix epoch, of a cache whose blocks
/// hold `block_size` tokens.
pub fn encode_batch(ts: f64, events: &[KvEvent], block_size: usize) -> Vec<u8> {
    let mut out = Vec::new();
    array_len(&mut out, 3);
    encode::write_f64(&mut out, ts).expect(WRITE);
    array_len(&mut out, events.len());
    for event in events {
        encode_event(&mut out, event, block_size);
    }
    // data_parallel_rank: a replica is one data-parallel rank, as a vLLM engine without DP reports.
    encode::write_uint(&mut out, 0).expect(WRITE);
    out
}

fn encode_event(out: &mut Vec<u8>, event: &KvEvent, block_size: usize) {
    match event {
        KvEvent::Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            namespace,
        } => {
            // vLLM puts the cache salt among the first block's extra keys (the keys its block hash covers
            // besides the tokens); Rill's stand-in is the block's prefix-cache namespace, which hashes the
            // salt and the LoRA adapter.
            let is_salted = parent_block_hash.is_none() && *namespace != 0;
            map_len(out, if is_salted { 9 } else { 8 });
            field_str(out, "type", "BlockStored");
            key(out, "block_hashes");
            hashes(out, block_hashes);
            key(out, "parent_block_hash");
            match parent_block_hash {
                Some(hash) => encode::write_u64(out, *hash).expect(WRITE),
                None => encode::write_nil(out).expect(WRITE),
            }
            key(out, "token_ids");
            uints(out, token_ids.iter().map(|&t| u64::from(t)));
            key(out, "block_size");
            encode::write_uint(out, block_size as u64).expect(WRITE);
            // LoRA adapters show in the namespace (extra keys), not by id or name.
            key(out, "lora_id");
            encode::write_nil(out).expect(WRITE);
            field_str(out, "medium", MEDIUM);
            key(out, "lora_name");
            encode::write_nil(out).expect(WRITE);
            if is_salted {
                key(out, "extra_keys");
                array_len(out, block_hashes.len());
                array_len(out, 1);
                encode::write_str(out, &format!("{namespace:016x}")).expect(WRITE);
                for _ in 1..block_hashes.len() {
                    encode::write_nil(out).expect(WRITE);
                }
            }
        }
        KvEvent::Removed { block_hashes } => {
            map_len(out, 3);
            field_str(out, "type", "BlockRemoved");
            key(out, "block_hashes");
            hashes(out, block_hashes);
            field_str(out, "medium", MEDIUM);
        }
        KvEvent::AllCleared => {
            map_len(out, 1);
            field_str(out, "type", "AllBlocksCleared");
        }
    }
}

const WRITE: &str = "writing msgpack to a Vec cannot fail";

fn array_len(out: &mut Vec<u8>, len: usize) {
    encode::write_array_len(out, u32::try_from(len).expect("arrays hold under 2^32 items")).expect(WRITE);
}

fn map_len(out: &mut Vec<u8>, len: u32) {
    encode::write_map_len(out, len).expect(WRITE);
}

fn key(out: &mut Vec<u8>, name: &str) {
    encode::write_str(out, name).expect(WRITE);
}

fn field_str(out: &mut Vec<u8>, name: &str, value: &str) {
    key(out, name);
    encode::write_str(out, value).expect(WRITE);
}

/// Block hashes always as msgpack's 8-byte uint64: llm-d-kv-cache v0.9.0 drops a whole batch holding a hash
/// in a smaller encoding ("unsupported hash type"), which a hash below 2^32 would otherwise get.
fn hashes(out: &mut Vec<u8>, values: &[u64]) {
    array_len(out, values.len());
    for &value in values {
        encode::write_u64(out, value).expect(WRITE);
    }
}

fn uints(out: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    array_len(out, values.len());
    for value in values {
        encode::write_uint(out, value).expect(WRITE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_encoded_byte_for_byte_as_msgspec_encodes_vllms_structs() {
        let events = [
            KvEvent::Stored {
                block_hashes: vec![0x1_0000_0007, u64::MAX],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                namespace: 255,
            },
            KvEvent::Stored {
                block_hashes: vec![0x1_0000_0009],
                parent_block_hash: Some(0x1_0000_0007),
                token_ids: vec![5, 6],
                namespace: 255,
            },
            KvEvent::Removed {
                block_hashes: vec![0x1_0000_0007],
            },
            KvEvent::AllCleared,
        ];
        // msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[...], data_parallel_rank=0)) with vLLM's
        // structs (EventBatch array_like, events tagged maps), the same events: the salted first chain
        // carries extra_keys [("00000000000000ff",), None]; a chain below a parent carries none.
        let expected =
            "93cb3ff80000000000009489a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf00000001\
            00000007cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa\
            626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa6578747261\
            5f6b6579739291b030303030303030303030303030306666c088a474797065ab426c6f636b53746f726564ac626c6f63\
            6b5f68617368657391cf0000000100000009b1706172656e745f626c6f636b5f68617368cf0000000100000007a9746f\
            6b656e5f696473920506aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f\
            6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf0000000100000007a6\
            6d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400";
        let hex: String = encode_batch(1.5, &events, 2)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(hex, expected);
    }

    #[test]
    fn a_small_block_hash_is_still_written_as_a_uint64() {
        let removed = [KvEvent::Removed { block_hashes: vec![7] }];
        let payload = encode_batch(1.5, &removed, 2);
        let hash = [0xcf, 0, 0, 0, 0, 0, 0, 0, 7];
        assert!(payload.windows(hash.len()).any(|w| w == hash), "{payload:02x?}");
    }
}
