//! The push as bytes: each chunk framed as a gRPC message whose block payload is the store's
//! own memory, lent by reference ([`KvStore::lend_envelope`]), or else written by the store
//! into the message's buffer on the way (one copy); and the acknowledgement decoded.
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use bytes::{BufMut, Bytes, BytesMut};
use kvwire::CRC32C_RESIDUE;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};
use tokio_stream::Stream;
use tonic::Status;
use tonic::codec::{DecodeBuf, Decoder};

use crate::pb::kv::{KvAck, KvChunk};
use crate::store::{BlockId, KvStore, StoreError};

/// The chunks of one push, produced lazily as the transport drains them.
pub type ChunkStream = Pin<Box<dyn Stream<Item = OutChunk> + Send>>;

/// A chunk on its way out. Its payload is either in the message already, or still a block in
/// the sender's pool, taken when the chunk is framed: lent by the store (no copy; a pool reads the
/// block for its CRC once per content, not once per send), or copied into the message's buffer with the CRC computed on the way.
#[derive(Clone, Debug)]
pub struct OutChunk {
    /// The chunk; its `payload` is empty while the block is still in the pool.
    pub chunk: KvChunk,
    pub(super) block: Option<LazyBlock>,
}

#[derive(Clone, Debug)]
pub(super) struct LazyBlock {
    pub(super) store: Arc<dyn KvStore>,
    pub(super) id: BlockId,
    pub(super) envelope_len: usize,
    pub(super) failed: Arc<Mutex<Option<StoreError>>>,
}

impl From<KvChunk> for OutChunk {
    fn from(chunk: KvChunk) -> Self {
        Self { chunk, block: None }
    }
}

impl OutChunk {
    /// True when the chunk carries a payload (in the message or still in the pool).
    #[must_use]
    pub fn has_payload(&self) -> bool {
        self.block.is_some() || !self.chunk.payload.is_empty()
    }

    /// The chunk with its payload in the message: the envelope written from the pool and its
    /// CRC-32C set. For transports that do not encode protobuf (an in-process one).
    ///
    /// # Errors
    /// When the block is no longer held (also recorded, so the transfer reports it).
    pub fn materialize(self) -> Result<KvChunk, StoreError> {
        let Some(block) = self.block else {
            return Ok(self.chunk);
        };
        let mut envelope = Vec::with_capacity(block.envelope_len);
        if let Err(e) = block.store.write_envelope(block.id, &mut envelope) {
            *block
                .failed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e.clone());
            return Err(e);
        }
        Ok(KvChunk {
            payload_crc32c: kvwire::crc32c(&envelope),
            payload: envelope.into(),
            ..self.chunk
        })
    }
}

/// Decodes the [`KvAck`] that answers a push.
#[derive(Debug, Default)]
pub(super) struct AckDecoder;

/// Writes `item` as a `tl.kv.v1.KvChunk`: prost's own encoding when the payload is in the
/// message; otherwise the same fields in tag order, exactly as prost would write them, with the
/// payload (tag 6) written from the pool straight into `buf`. `push_encoder_matches_prost`
/// holds the two to the same bytes.
pub(super) fn encode_chunk<B: BufMut>(item: OutChunk, buf: &mut B) -> Result<(), Status> {
    let Some(block) = item.block else {
        return item
            .chunk
            .encode(buf)
            .map_err(|e| Status::internal(format!("encoding a chunk: {e}")));
    };
    let c = &item.chunk;
    fields_before_payload(c, block.envelope_len, buf);
    let before = buf.remaining_mut();
    if let Err(e) = block.store.write_envelope(block.id, buf) {
        return Err(block.fail(e));
    }
    debug_assert_eq!(before - buf.remaining_mut(), block.envelope_len);
    fields_after_payload(c, buf);
    Ok(())
}

/// Fields 1 to 5 of a chunk, then the key and length of its payload (tag 6), as prost writes
/// them.
fn fields_before_payload<B: BufMut>(c: &KvChunk, payload_len: usize, buf: &mut B) {
    use prost::encoding::{string, uint32, uint64};
    if !c.handle_id.is_empty() {
        string::encode(1, &c.handle_id, buf);
    }
    if c.index != 0 {
        uint32::encode(2, &c.index, buf);
    }
    if c.total != 0 {
        uint32::encode(3, &c.total, buf);
    }
    if c.hash != 0 {
        uint64::encode(4, &c.hash, buf);
    }
    if c.kv_format != 0 {
        uint32::encode(5, &c.kv_format, buf);
    }
    encode_key(6, WireType::LengthDelimited, buf);
    encode_varint(payload_len as u64, buf);
}

/// Fields 7 to 10 of a chunk whose payload is a whole envelope: its CRC-32C is then the
/// residue (no second pass over the payload).
fn fields_after_payload<B: BufMut>(c: &KvChunk, buf: &mut B) {
    use prost::encoding::{fixed32, string, uint32, uint64};
    fixed32::encode(7, &CRC32C_RESIDUE, buf);
    if !c.model.is_empty() {
        string::encode(8, &c.model, buf);
    }
    // Packed, as proto3 writes a repeated scalar.
    uint32::encode_packed(9, &c.tokens, buf);
    if c.cache_scope != 0 {
        uint64::encode(10, &c.cache_scope, buf);
    }
}

impl LazyBlock {
    /// Records why the block could not be sent (the transfer reports it) and the status the
    /// call fails with.
    fn fail(&self, e: StoreError) -> Status {
        let msg = e.to_string();
        *self
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
        Status::internal(msg)
    }
}

/// gRPC's message prefix: the compression flag (0) and the big-endian length.
const PREFIX: usize = 5;

/// Appends `item` to `out` as one gRPC message (prefix and `KvChunk`), in `Bytes` that are
/// joined only by the socket: when the store lends a full block's envelope
/// ([`KvStore::lend_envelope`]) the message is three pieces, the prefix and fields before the
/// payload, the envelope in the pool's own memory, then the fields after it (the receiver
/// decodes the envelope out of its frame by reference). Otherwise it is one buffer written as
/// [`encode_chunk`] writes. Joined, the pieces are exactly tonic's
/// encoding of the same chunk (`push_encoder_matches_prost`).
///
/// # Errors
/// OUT_OF_RANGE over `max` (tonic's message); INTERNAL when the block is no longer held (also
/// recorded for the transfer).
pub(super) fn encode_message(
    item: OutChunk,
    max: usize,
    out: &mut VecDeque<Bytes>,
) -> Result<(), Status> {
    let too_large = |len: usize| {
        Status::out_of_range(format!(
            "Error, encoded message length too large: found {len} bytes, the limit is: {max} bytes"
        ))
    };
    let lent = match &item.block {
        Some(block) => block
            .store
            .lend_envelope(block.id)
            .map_err(|e| block.fail(e))?,
        None => None,
    };
    let Some(envelope) = lent else {
        let reserve = item.block.as_ref().map_or(0, |b| b.envelope_len);
        let c = &item.chunk;
        let mut buf = BytesMut::with_capacity(
            PREFIX + reserve + c.handle_id.len() + c.model.len() + 5 * c.tokens.len() + 80,
        );
        buf.put_bytes(0, PREFIX);
        encode_chunk(item, &mut buf)?;
        let len = buf.len() - PREFIX;
        if len > max {
            return Err(too_large(len));
        }
        buf[1..PREFIX].copy_from_slice(&(len as u32).to_be_bytes());
        out.push_back(buf.freeze());
        return Ok(());
    };
    let c = &item.chunk;
    let mut before = BytesMut::with_capacity(PREFIX + 48 + c.handle_id.len());
    before.put_bytes(0, PREFIX);
    fields_before_payload(c, envelope.len(), &mut before);
    let mut after = BytesMut::with_capacity(32 + c.model.len() + 5 * c.tokens.len());
    fields_after_payload(c, &mut after);
    let len = before.len() - PREFIX + envelope.len() + after.len();
    if len > max {
        return Err(too_large(len));
    }
    before[1..PREFIX].copy_from_slice(&(len as u32).to_be_bytes());
    out.push_back(before.freeze());
    out.push_back(envelope);
    out.push_back(after.freeze());
    Ok(())
}

impl Decoder for AckDecoder {
    type Item = KvAck;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<KvAck>, Status> {
        KvAck::decode(buf)
            .map(Some)
            .map_err(|e| Status::internal(format!("decoding KvAck: {e}")))
    }
}
