//! A new delivery's identity (`x-delayd-id`, see [`crate::id`]).

use crate::id::MessageId;

/// A Kafka record's identity: it follows from where the record was read
/// (the same if it is read again). `None` for any other message.
pub fn kafka_identity(message: &delayd_adapters::Message) -> Option<MessageId> {
    let (partition, offset) = message.partition.zip(message.offset)?;
    Some(MessageId::of_kafka_record(
        &message.source,
        partition,
        offset,
        message.timestamp_ms,
    ))
}

/// A RabbitMQ stream delivery's identity: it follows from the stream (the
/// queue `stream`) and the offset it was read at, and its bytes, so a
/// stream deleted and declared again does not give a new message an old
/// one's id. `None` for any other message.
pub fn stream_identity(
    message: &delayd_adapters::Message,
    stream: &str,
    encoded: &[u8],
) -> Option<MessageId> {
    if message.partition.is_some() {
        return None;
    }
    let offset = message.offset?;
    Some(MessageId::of_stream_record(stream, offset, encoded))
}

/// A new delivery's identity: a Kafka record's follows from where it was
/// read; any other is minted.
pub fn identity_of(message: &delayd_adapters::Message) -> MessageId {
    kafka_identity(message).unwrap_or_else(MessageId::mint)
}
