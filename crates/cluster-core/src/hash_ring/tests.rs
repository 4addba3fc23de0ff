//! Golden assignments computed with the reference's 4.1.0 dist, and properties of the ring.

use std::collections::BTreeMap;

use expect_test::expect;
use proptest::prelude::*;

use super::*;

fn ring_of(hosts: &[&str], weights: &[f64]) -> HashRing<RunnerAddress> {
    let mut ring = HashRing::new();
    for (idx, host) in hosts.iter().enumerate() {
        ring.add(RunnerAddress::new(*host, 34431), weights.get(idx).copied().unwrap_or(1.0));
    }
    ring
}

/// The owners of 300 shards, each written as the host's last character (an octet or a letter).
fn owners(ring: &HashRing<RunnerAddress>) -> String {
    ring.get_shards(300)
        .unwrap()
        .iter()
        .map(|address| address.host().chars().last().unwrap())
        .collect()
}

fn counts(owners: &str) -> BTreeMap<char, usize> {
    let mut counts = BTreeMap::new();
    for owner in owners.chars() {
        *counts.entry(owner).or_insert(0) += 1;
    }
    counts
}

#[test]
fn two_equal_runners() {
    let owners = owners(&ring_of(&["host-a", "host-b"], &[]));
    assert_eq!(&owners[..10], "aaaaaababb");
    assert_eq!(counts(&owners), BTreeMap::from([('a', 150), ('b', 150)]));
    expect![[r#"aaaaaababbaabbababbbbbbbaaabababbabbbbbaaaabbbbabbbbabaaabbbaaaaaaaaababbaaabaabbbbbabbabaabbabaabaaaabbaabbaabaabaabbbbaaabaaaabbaaabaaaabbbbbabababaabaaabbaaaabaababaaabbbabbbbabaabaabbbbabbbbbababbbabbbabbabbabbbbaaaaabbabaaabaabbaaabbbabbbbbbabbbbaaaababbbaaabbaabbbaabbaabaababaaaaaaabaabbbabaab"#]]
    .assert_eq(&owners);
}

#[test]
fn three_runners_then_a_fourth() {
    let hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
    let mut ring = ring_of(&hosts, &[]);
    let three = owners(&ring);
    assert_eq!(&three[..20], "23213131121222322233");
    assert_eq!(counts(&three), BTreeMap::from([('1', 100), ('2', 100), ('3', 100)]));
    expect![[r#"232131311212223222333122313331232222112221212313232211232233132333223313213112111332231211323213221312121222313333113122312321221121312231313212313112323223322213312313231213332111311312213113113311111112213113211221232221132323331123312232312322323212311233311233333223323111223321112121313133113123"#]]
    .assert_eq(&three);

    ring.add(RunnerAddress::new("10.0.0.4", 34431), 1.0);
    let four = owners(&ring);
    assert_eq!(&four[..20], "24213142141222324233");
    assert_eq!(counts(&four), BTreeMap::from([('1', 75), ('2', 75), ('3', 75), ('4', 75)]));
    expect![[r#"242131421412223242334142413331232242414223214313432241242243142444223343213412114332241211423414221312121222314334114422312321243123434241443214313114323224322213314313431213332141431312233134434311111134213443211224432241142344331123314234212324344212311443311233434444324141223341112143313144114423"#]]
    .assert_eq(&four);

    let moved: Vec<(char, char)> =
        three.chars().zip(four.chars()).filter(|(before, after)| before != after).collect();
    assert_eq!(moved.len(), 87);
    assert_eq!(moved.iter().filter(|(_, after)| *after == '4').count(), 75);
}

#[test]
fn weighted_runners() {
    let weighted = owners(&ring_of(&["host-a", "host-b"], &[2.0, 1.0]));
    assert_eq!(counts(&weighted), BTreeMap::from([('a', 200), ('b', 100)]));
    expect![[r#"aaaaaaaaabaaaaaaabbbbbbaaaaaababbabbbbaaaaaaabbaaaababaaabbbaabaaaaaababbaaabaababababaabaabbaaaabaaaabaaabaaaaaabaaabbbaaabaaaaabaaabaaaabbbbbabaaabaaaaaaabaaaabaababaaabbbaabaaaaaabaabbbaaabbbbaaaabbabbaabaaabababaaaaaabbabaaabaaabaaaabbaaababaababaaaaabaabbaaabbaababaabbaabaababaaaaaaabaaabaabaaa"#]]
    .assert_eq(&weighted);

    let fractional = owners(&ring_of(&["a", "b", "c"], &[1.0, 1.5, 0.3]));
    assert_eq!(counts(&fractional), BTreeMap::from([('a', 107), ('b', 161), ('c', 32)]));
    expect![[r#"abbbbabbbabcbaaababbabaaaababaababaababbabaaaaaabbabbbabaabaabbcababaabcbbbbaaaccbbaabbbbbbbbbbbcbabbbacbbaccbabbbccbbaabaabaaaabbabbaaabcabbcccbcbcabbcaaababbababbacbcaaaaabbbbbbbbbaababcbbbabcbbbbcbbbcaabbcbbbaabbbbbbcbbbbbcbbbabbabbbbbcaabaabcbaabbbcbabbbbacabbaabbbababbbabaaabababbaaaababbbabacb"#]]
    .assert_eq(&fractional);
}

#[test]
fn seven_runners_leave_a_remainder() {
    let hosts: Vec<String> = (1..=7).map(|octet| format!("10.0.0.{octet}")).collect();
    let hosts: Vec<&str> = hosts.iter().map(String::as_str).collect();
    let owners = owners(&ring_of(&hosts, &[]));
    // 7 × floor(300 / 7) = 294; the 6 left over go to their nearest runners, unbalanced.
    assert_eq!(
        counts(&owners),
        BTreeMap::from([
            ('1', 47),
            ('2', 42),
            ('3', 42),
            ('4', 42),
            ('5', 42),
            ('6', 42),
            ('7', 43)
        ])
    );
    expect![[r#"777151461517273272344462443531232665515225714757465645256267742645726543225512136632261253773414725712125227717374515426652371246526436555766214313154373775362256655313431233737145561352263164436351531166677643215724432641142644331127117236712766344715771473311273457454364541567361612147313147114566"#]]
    .assert_eq(&owners);
}

#[test]
fn readding_with_another_weight_replaces_the_points() {
    let mut ring = ring_of(&["a", "b"], &[]);
    ring.add(RunnerAddress::new("a", 34431), 3.0);
    ring.add(RunnerAddress::new("b", 34431), 0.01); // clamped to 0.1
    let owners = owners(&ring);
    assert_eq!(counts(&owners), BTreeMap::from([('a', 291), ('b', 9)]));
    expect![[r#"aaaaabaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaabaaaaaaaaaaaaaaaaaaaaaaabaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaabaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaabaaaaaaaaaaaaaaaaaabaaaaaaaaaaaaaaaaaabaaaaaaaaaaaaaaaaaaabaaaaaaaaaaaaaaaabaaaaaaaaaaaaaaaaaaaaaaaa"#]]
    .assert_eq(&owners);
}

#[test]
fn fewer_shards_than_runners_and_nearest_lookup() {
    let three = ring_of(&["10.0.0.1", "10.0.0.2", "10.0.0.3"], &[]);
    let looked_up: Vec<&str> = ["", "a", "user-42", "shard-0", "x:1"]
        .iter()
        .map(|key| three.get(key).unwrap().host())
        .collect();
    assert_eq!(looked_up, ["10.0.0.2", "10.0.0.2", "10.0.0.3", "10.0.0.2", "10.0.0.3"]);

    let short = |ring: &HashRing<RunnerAddress>, count| -> String {
        ring.get_shards(count).unwrap().iter().map(|address| address.host().to_owned()).collect()
    };
    assert_eq!(short(&ring_of(&["a", "b", "c"], &[]), 10), "caabbbccaa");
    assert_eq!(short(&ring_of(&["a", "b", "c", "d", "e"], &[]), 3), "eba");
    assert_eq!(ring_of(&["a"], &[]).get_shards(0).unwrap().len(), 0);
}

#[test]
fn empty_ring_and_removal() {
    let mut ring: HashRing<RunnerAddress> = HashRing::new();
    assert!(ring.get("x").is_none());
    assert!(ring.get_shards(300).is_none());
    let a = RunnerAddress::new("a", 1);
    ring.add(a.clone(), 1.0);
    assert!(ring.contains(&a));
    ring.remove(&a);
    assert!(ring.is_empty());
    assert!(ring.get_shards(300).is_none());
}

fn address_set() -> impl Strategy<Value = Vec<(RunnerAddress, u8)>> {
    proptest::collection::btree_map("[a-z0-9.-]{1,12}", 1u8..=4, 1..8).prop_map(|hosts| {
        hosts.into_iter().map(|(host, weight)| (RunnerAddress::new(host, 34431), weight)).collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn assignment_depends_only_on_the_set_of_runners(
        runners in address_set(),
        seed in any::<u64>(),
    ) {
        let mut forward = HashRing::new();
        for (address, weight) in &runners {
            forward.add(address.clone(), f64::from(*weight));
        }
        // A permutation drawn from the seed, plus a removed and re-added runner.
        let mut shuffled = runners;
        let n = shuffled.len();
        for idx in 0..n {
            let swap = usize::try_from((seed >> (idx % 60)) % u64::try_from(n).unwrap()).unwrap();
            shuffled.swap(idx, swap);
        }
        let mut permuted = HashRing::new();
        for (address, weight) in &shuffled {
            permuted.add(address.clone(), 2.0);
            permuted.add(address.clone(), f64::from(*weight));
        }
        prop_assert_eq!(forward.get_shards(300), permuted.get_shards(300));
    }

    #[test]
    fn every_runner_gets_at_least_its_floor_share(runners in address_set(), count in 0u32..600) {
        let mut ring = HashRing::new();
        for (address, weight) in &runners {
            ring.add(address.clone(), f64::from(*weight));
        }
        let shards = ring.get_shards(count).unwrap();
        prop_assert_eq!(shards.len(), usize::try_from(count).unwrap());
        let total: f64 = runners.iter().map(|(_, weight)| f64::from(*weight)).sum();
        let floors: Vec<u32> = runners
            .iter()
            .map(|(_, weight)| {
                // The reference's share, `count × (weight / total)`, rounding included.
                let floor = (f64::from(count) * (f64::from(*weight) / total)).floor();
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "a floor of 0..=600"
                )]
                let floor = floor as u32;
                floor
            })
            .collect();
        // Every runner may take at least one shard (`max(floor, 1)`, as the reference), so with
        // few shards the maxima can add up to more than `count`.
        let maxima: Vec<u32> = floors.iter().map(|floor| (*floor).max(1)).collect();
        let demand: u32 = maxima.iter().sum();
        let mut excess = 0u32;
        for ((address, _), max) in runners.iter().zip(&maxima) {
            let owned = u32::try_from(shards.iter().filter(|owner| **owner == address).count()).unwrap();
            if demand <= count {
                // Each runner reaches its weighted share before any runner goes beyond it ...
                prop_assert!(owned >= *max, "{address} owns {owned} < {max}");
                excess += owned - max;
            } else {
                // ... and when there are too few shards for that, none goes beyond it.
                prop_assert!(owned <= *max, "{address} owns {owned} > {max}");
            }
        }
        // ... so only the remainder of the integer division is spread unevenly.
        let n_runners = u32::try_from(runners.len()).unwrap();
        if demand <= count {
            prop_assert!(excess < n_runners, "excess {excess} with {n_runners} runners");
        }
    }

    #[test]
    fn nearest_lookup_moves_keys_only_to_an_added_runner(
        runners in address_set(),
        keys in proptest::collection::vec(any::<String>(), 1..50),
    ) {
        let mut ring = HashRing::new();
        for (address, weight) in &runners {
            ring.add(address.clone(), f64::from(*weight));
        }
        let before: Vec<RunnerAddress> = keys.iter().map(|key| ring.get(key).unwrap().clone()).collect();
        let added = RunnerAddress::new("added-runner", 1);
        ring.add(added.clone(), 1.0);
        for (key, owner) in keys.iter().zip(before) {
            let now = ring.get(key).unwrap();
            prop_assert!(*now == owner || *now == added, "{key:?} moved from {owner} to {now}");
        }
    }

    #[test]
    fn an_added_runner_gets_its_share_and_most_of_the_moves(runners in address_set()) {
        let mut ring = HashRing::new();
        for (address, _) in &runners {
            ring.add(address.clone(), 1.0);
        }
        let before: Vec<RunnerAddress> = ring.get_shards(300).unwrap().into_iter().cloned().collect();
        let added = RunnerAddress::new("added-runner", 1);
        ring.add(added.clone(), 1.0);
        let after = ring.get_shards(300).unwrap();
        let n_runners = u32::try_from(runners.len()).unwrap() + 1;
        let to_added = after.iter().filter(|owner| ***owner == added).count();
        prop_assert!(u32::try_from(to_added).unwrap() >= 300 / n_runners);
        let moved = before.iter().zip(&after).filter(|(old, new)| *old != **new).count();
        prop_assert!(moved >= to_added);
    }
}
