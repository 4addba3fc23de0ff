//! The decoding of stored message and reply rows from arbitrary column values (a row a
//! TypeScript runner, an operator or a bug wrote).
#![no_main]

use cluster_storage_sql::fuzzing::{MessageColumns, ReplyColumns, decode_message, decode_reply};
use libfuzzer_sys::arbitrary::{self, Arbitrary};

#[derive(Arbitrary, Debug)]
enum Row {
    Message(MessageColumns),
    Reply(ReplyColumns),
}

libfuzzer_sys::fuzz_target!(|row: Row| match row {
    Row::Message(columns) => decode_message(columns),
    Row::Reply(columns) => decode_reply(columns),
});
