//! The push as bytes: each chunk encoded straight into the gRPC buffer, a block's envelope
//! written by its store on the way (no intermediate copy), and the acknowledgement decoded.
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use bytes::BufMut;
use kvwire::CRC32C_RESIDUE;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};
use tokio_stream::Stream;
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

use crate::pb::kv::{KvAck, KvChunk};
use crate::store::{BlockId, KvStore, StoreError};

/// The chunks of one push, produced lazily as the transport drains them.
pub type ChunkStream = Pin<Box<dyn Stream<Item = OutChunk> + Send>>;

/// A chunk on its way out. Its payload is either in the message already, or still a block in
/// the sender's pool, copied straight into the gRPC encode buffer when the chunk is encoded: one
/// copy from the slab to the wire buffer, with the envelope's CRC computed on the way.
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

/// Encodes [`OutChunk`]s as `tl.kv.v1.KvChunk` (writing a lazy payload from the pool) and
/// decodes [`KvAck`]s.
#[derive(Debug, Default)]
pub(super) struct PushCodec;

#[derive(Debug, Default)]
pub(super) struct PushEncoder;

#[derive(Debug, Default)]
pub(super) struct AckDecoder;

impl Codec for PushCodec {
    type Encode = OutChunk;
    type Decode = KvAck;
    type Encoder = PushEncoder;
    type Decoder = AckDecoder;

    fn encoder(&mut self) -> PushEncoder {
        PushEncoder
    }

    fn decoder(&mut self) -> AckDecoder {
        AckDecoder
    }
}

impl Encoder for PushEncoder {
    type Item = OutChunk;
    type Error = Status;

    fn encode(&mut self, item: OutChunk, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        if let Some(block) = &item.block {
            // One allocation for the whole message: the envelope is written in place.
            let c = &item.chunk;
            buf.reserve(
                block.envelope_len + c.handle_id.len() + c.model.len() + 5 * c.tokens.len() + 80,
            );
        }
        encode_chunk(item, buf)
    }
}

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
    use prost::encoding::{fixed32, string, uint32, uint64};
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
    encode_varint(block.envelope_len as u64, buf);
    let before = buf.remaining_mut();
    if let Err(e) = block.store.write_envelope(block.id, buf) {
        let msg = e.to_string();
        *block
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
        return Err(Status::internal(msg));
    }
    debug_assert_eq!(before - buf.remaining_mut(), block.envelope_len);
    // The CRC-32C of a whole valid envelope is the residue: no second pass needed.
    fixed32::encode(7, &CRC32C_RESIDUE, buf);
    if !c.model.is_empty() {
        string::encode(8, &c.model, buf);
    }
    // Packed, as proto3 writes a repeated scalar.
    uint32::encode_packed(9, &c.tokens, buf);
    if c.cache_scope != 0 {
        uint64::encode(10, &c.cache_scope, buf);
    }
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
