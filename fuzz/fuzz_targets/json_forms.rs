//! The reference's JSON forms of envelopes, replies, exits and runner records, and chunk
//! values: whatever decodes encodes to text that decodes to the same value.
#![no_main]

use durable_cluster::cluster_core::Runner;
use durable_cluster::cluster_core::encoded::{JsonForm, values_from_json, values_to_json};
use durable_cluster::cluster_core::envelope::{Envelope, Exit, Reply};

fn round_trip<T: JsonForm>(text: &str) {
    if let Ok(value) = T::from_json(text) {
        let encoded = value.to_json();
        let again = T::from_json(&encoded)
            .unwrap_or_else(|error| panic!("{encoded} does not decode again: {error}"));
        assert_eq!(again.to_json(), encoded, "a value changed on a round trip");
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    round_trip::<Envelope>(text);
    round_trip::<Reply>(text);
    round_trip::<Exit>(text);
    round_trip::<Runner>(text);
    if let Ok(values) = values_from_json(text) {
        let encoded = values_to_json(&values);
        assert!(values_from_json(&encoded).is_ok(), "{encoded} does not decode again");
    }
});
