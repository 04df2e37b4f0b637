//! Whose rules answer where gpualloc's caching allocator and PyTorch's differ.
//!
//! A [`Policy`] is a named set of rule choices. `pytorch` is PyTorch's main branch, every rule
//! as it is, including the ones gpualloc considers mistakes: the replay tool answers with it by
//! default, because "what would PyTorch do with my job under this config?" is the question its
//! users ask. `gpualloc` is ours: each of its departures is listed in [`DEVIATIONS`] (and in
//! the README's replay section), with why and the figure that shows its effect. The allocator
//! itself defaults to `gpualloc`; the config key `policy:pytorch` makes it behave as PyTorch.

use std::fmt;

/// A named set of rule choices (config key `policy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Policy {
    /// PyTorch's `CUDACachingAllocator`, rule for rule.
    Pytorch,
    /// gpualloc's rules: PyTorch's, except the [`DEVIATIONS`].
    #[default]
    Gpualloc,
}

impl Policy {
    /// Both policies, PyTorch's first.
    pub const ALL: [Policy; 2] = [Policy::Pytorch, Policy::Gpualloc];

    /// The name the config key and the replay tool use.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Pytorch => "pytorch",
            Policy::Gpualloc => "gpualloc",
        }
    }

    /// The policy called `name` (`pytorch` or `gpualloc`).
    pub fn from_name(name: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether `max_split_size` limits blocks of expandable segments too. PyTorch: yes (an
    /// oversize free block is not handed to a small request, nor to a large one it exceeds by
    /// more than `max_non_split_rounding`). gpualloc: no; see [`DEVIATIONS`].
    pub fn max_split_limits_expandable(self) -> bool {
        self == Policy::Pytorch
    }

    /// Whether a large-pool request in an expandable segment passes over a best fit that
    /// would leave a dead remainder (`placement.rs`). PyTorch: no. gpualloc: yes; see
    /// [`DEVIATIONS`].
    pub fn avoids_dead_remainders(self) -> bool {
        self == Policy::Gpualloc
    }

    /// Whether the large pool of expandable segments has 2 MiB pages, several to a physical
    /// handle, and grows ahead of the request (`map_ahead.rs`). PyTorch: no, one handle per
    /// `large_segment_size` page. gpualloc: yes; see [`DEVIATIONS`].
    pub fn fine_large_pages(self) -> bool {
        self == Policy::Gpualloc
    }

    /// Whether a request that misses its own stream's free blocks may take another stream's,
    /// ordered after that stream's work by an event, before new memory (`streams/loans.rs`).
    /// PyTorch: no, a stream's cached blocks serve only it. gpualloc: yes; see [`DEVIATIONS`].
    pub fn lends_across_streams(self) -> bool {
        self == Policy::Gpualloc
    }

    /// Whether, after the user's `empty_cache`, a growth of an expandable segment past the
    /// most ever held first releases the cache (as `empty_cache` does), up to
    /// `RELEASES_PER_EMPTY_CACHE` times per `empty_cache` (`miss/chain.rs`). PyTorch: no, it
    /// releases only when the device is full. gpualloc: yes; see [`DEVIATIONS`].
    pub fn releases_before_growth(self) -> bool {
        self == Policy::Gpualloc
    }

    /// Whether a growth of the default large pool's expandable segment past the most ever held
    /// first unmaps the default pools' free pages, once per rise of that mark
    /// (`miss/chain.rs`). PyTorch: no.
    /// gpualloc: yes; see [`DEVIATIONS`].
    pub fn moves_pages_before_growth(self) -> bool {
        self == Policy::Gpualloc
    }

    /// Whether a small request that misses the default small pool, of a size learned to be
    /// short-lived, takes a free block of the default large pool's expandable segment before
    /// a new small page (`malloc/spill.rs`). PyTorch: no, the pools never share memory.
    /// gpualloc: yes; see [`DEVIATIONS`].
    pub fn spills_small_requests(self) -> bool {
        self == Policy::Gpualloc
    }

    /// Whether a config that does not name `expandable_segments` uses them where the backend
    /// has virtual memory ([`crate::AllocatorConfig::resolved`]). PyTorch: no, ordinary
    /// segments unless asked. gpualloc: yes; see [`DEVIATIONS`].
    pub fn expandable_by_default(self) -> bool {
        self == Policy::Gpualloc
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One rule where the `gpualloc` policy departs from PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deviation {
    /// The rule.
    pub rule: &'static str,
    /// What PyTorch does.
    pub pytorch: &'static str,
    /// What gpualloc does.
    pub gpualloc: &'static str,
    /// Why.
    pub why: &'static str,
    /// The figure that shows the effect, and where it comes from.
    pub evidence: &'static str,
}

/// Every departure from PyTorch's rules (the `gpualloc` policy's, and the allocator's under
/// stream capture, whatever the policy): the one copy of the table.
/// The README shows it as [`deviations_table`] renders it (`devices/tests/departures.rs`
/// checks that they are the same); cells are Markdown.
pub const DEVIATIONS: &[Deviation] = &[
    Deviation {
        rule: "`max_split_size` with expandable segments",
        pytorch: "limits expandable blocks as any other: a free block of at least `max_split_size` \
                   is not given to a smaller request, nor to a larger one it exceeds by more than \
                   `max_non_split_rounding`",
        gpualloc: "limits only blocks of ordinary segments (the proposal of PyTorch PR #193400, not \
                    merged)",
        why: "in an expandable segment a freed oversize block cannot be released while a live block \
               follows it, so refusing it maps new pages for every such request: reserved memory \
               grows without bound in a plain alloc/free cycle",
        evidence: "`max_split_size_mb:128,expandable_segments:True`, peak reserved: \
                    llama-lora-finetune 5.74 GiB (PyTorch) vs 5.51 GiB, transformer-lm-train 13.26 \
                    GiB vs 12.98 GiB; a 100-cycle alloc/free loop (`devices/tests/expandable.rs`): \
                    8,200 MiB vs 280 MiB",
    },
    Deviation {
        rule: "best fit in expandable segments (dead remainders)",
        pytorch: "a large-pool request takes the smallest free block that holds it and splits off \
                   whatever remains, 512 B or more",
        gpualloc: "a best fit that would leave under 512 KiB (and is not the segment's tail) is \
                    passed over for the tail, which grows if it must; where it cannot grow the \
                    passed-over block is taken after all, before any cache is released \
                    (`devices/src/malloc/placement.rs`)",
        why: "every large-pool request is over 1 MiB, so such a remainder is dead until a neighbour \
               is freed; kept activations landing in the holes of freed temporaries pile them up",
        evidence: "`expandable_segments:True`, peak reserved: transformer-lm-forward-bf16 786 MiB \
                    (PyTorch) vs 766 MiB, fragmentation 5.38% vs 2.91%; the other two traces \
                    unchanged (`devices/tests/placement.rs`)",
    },
    Deviation {
        rule: "large-pool pages of expandable segments",
        pytorch: "20 MiB pages (`large_segment_size`), one physical handle each; a growth maps the \
                   pages the request needs",
        gpualloc: "2 MiB pages, in physical handles as the next row says; a growth maps 1/8 \
                    of what the segment has mapped ahead of the request, never past the next 20 MiB \
                    boundary from the segment's base (where PyTorch's page would end), and once 1/8 \
                    reaches 20 MiB grows to that boundary as PyTorch does; the pages ahead are \
                    dropped where the device or `per_process_memory_fraction` has no room, and the \
                    fraction counts the pages mapped, not a 20 MiB segment \
                    (`devices/src/malloc/map_ahead.rs`)",
        why: "on a small model a 20 MiB page is most of the memory reserved and unused; the 20 MiB \
               boundary keeps large segments as PyTorch lays them out",
        evidence: "`expandable_segments:True`, peak reserved: a generated MiniLM-like inference \
                    (`replay/tests/small_model.rs`) 92 MiB (PyTorch) vs 84 MiB, fragmentation 14.05% \
                    vs 5.86%; the seven shared traces at PyTorch's peak or below but \
                    llama7b-offload-10streams (+4 MiB before loans between streams), driver map calls 18 against 9 on \
                    cnn-counterfactual-small, +0.05% to +9.5% on the others \
                    (`replay/tests/real_traces.rs`, `devices/tests/map_ahead.rs`; figures from before \
                    the handles of the next row)",
    },
    Deviation {
        rule: "physical handles of a growth of the large pool's expandable segments",
        pytorch: "one handle per 20 MiB page",
        gpualloc: "in the default large pool, the pages wholly inside the request share handles of up \
                    to 20 MiB and the pages after them (the page the request ends in, the pages \
                    ahead) are handles as the row on pages ahead below says (a private pool's \
                    growth stays one handle); a history's `segment_map` records the split \
                    (`gpualloc_grouped_pages`, `gpualloc_single_pages`) so a replay maps the same \
                    handles (`devices/src/malloc/map_ahead.rs`)",
        why: "a handle is released only whole, so one reaching past its request kept the free pages \
               between live blocks mapped: no release or page move could give them back",
        evidence: "default config, peak reserved (fragmentation): transformer-lm-forward-bf16 \
                    762 -> 756 MiB (2.40% -> 1.63%), qwen2-7b-layerwise-calib 4,222 -> 4,202 MiB \
                    (1.71% -> 1.25%), llama7b-offload-10streams 19,938 -> 19,870 MiB (0.50% -> \
                    0.16%), qwen3-gcn devices 0/1/2 0.83/0.17/0.70% -> 0.29/0.10/0.25%, \
                    llama-lora-finetune 0.67% -> 0.64%, the others unchanged; qwen3-gcn device 2 \
                    with `max_split_size_mb:128` 20,710 -> 20,618 MiB, under PyTorch's 20,680 (it \
                    was the one case above PyTorch). Driver map calls: transformer-lm-forward 47 \
                    -> 326 (PyTorch with expandable segments 42), cnn-counterfactual 18 -> 39 (9), \
                    llama-lora 379 -> 1,297 (328), transformer-lm-train 696 -> 2,129 (672), qwen2 \
                    9,363 -> 11,890 (5,811), llama7b 10,697 -> 11,335 (8,042) \
                    (`replay/tests/real_traces.rs`, `devices/tests/map_ahead.rs`, \
                    `devices/tests/oom_chain.rs`)",
    },
    Deviation {
        rule: "pages ahead once free pages were moved, and the handles of the pages ahead",
        pytorch: "no pages ahead; one handle per 20 MiB page",
        gpualloc: "once a growth has moved free pages (the page move before a growth, a row below), \
                    no growth of the core maps pages ahead again; of the pages a growth maps after \
                    the request's whole pages, the first two (the page the request ends in, the \
                    first page ahead) are a handle each and the rest of the pages ahead share \
                    handles of up to 20 MiB (`devices/src/malloc/map_ahead.rs`, \
                    `devices/src/budget.rs`)",
        why: "a page move shows the job at the most memory it needs, where pages ahead are held \
               unused at its peak; and the free pages the moves gave back were measured at the \
               pages where a request ends and the next begins, so a handle for every page \
               further ahead cost up to ten driver calls per growth for pages no move took",
        evidence: "default config, peak reserved (fragmentation) / driver maps: \
                    transformer-lm-forward-bf16 756 -> 758 MiB (1.63% -> 1.89%) / 324 -> 141 \
                    (PyTorch with expandable segments 42: 7.7x -> 3.4x); llama-lora-finetune 5,634 \
                    -> 5,630 (0.53% -> 0.46%) / 1,269 -> 644; qwen2-7b-layerwise-calib 4,202 -> \
                    4,182 (1.25% -> 0.77%) / 11,890 -> 9,809; transformer-lm-train 13,296 -> \
                    13,280 (0.13% -> 0.01%) / 2,129 -> 1,103; llama7b-offload-10streams 19,870 -> \
                    19,878 (0.16% -> 0.20%) / 11,335 -> 10,581; qwen3-gcn devices 0/1/2 \
                    0.29/0.10/0.25% -> 0.61/0.07/0.27% / 1,455/4,877/1,758 -> 890/4,729/1,433; \
                    cnn-counterfactual-small 104 MiB / 36 -> 35. Growths at most 1.5x PyTorch's \
                    (qwen3-gcn device 0: 303 vs 204). Every trace and config's maps at most 4x \
                    PyTorch's with expandable segments (asserted; `replay/tests/real_traces.rs`, \
                    `devices/tests/release_before_growth.rs`, `devices/tests/map_ahead.rs`)",
    },
    Deviation {
        rule: "another stream's free blocks (loans)",
        pytorch: "a cached block serves only the stream it was freed on; a request that misses \
                   its own stream's blocks gets new memory (or releases the cache)",
        gpualloc: "before new memory, a large-pool request takes the best-fitting free block of \
                    another stream of the default large pool, under its pool's size rules (small \
                    blocks are not lent: a loan saves at most their 2 MiB page and costs events at \
                    every reuse): an event recorded on \
                    the lender and waited for by the borrower orders it after the lender's work \
                    (no synchronization, no driver memory call); the block stays the lender's and \
                    goes back to it once an event on the borrower completes, as a `record_stream` \
                    free does. Not during an announced capture, nor to or from a capturing \
                    stream; a loan the backend cannot order is not made \
                    (`devices/src/streams/loans.rs`)",
        why: "streams that peak at different times (an offload engine's copy streams and its \
               compute stream) otherwise keep every stream's peak reserved at once: each stream's \
               free memory strands there",
        evidence: "default config, llama7b-offload-10streams (10 streams): peak reserved 21,128 \
                    MiB before loans vs 20,852 MiB (PyTorch 21,476), fragmentation 6.10% vs 4.86%, \
                    growths 752 vs 642; `expandable_segments:False` 21,476 (PyTorch) vs 21,220 MiB, \
                    segment mallocs 728 vs 564; the six one-stream traces unchanged; two streams \
                    taking turns with 200 MiB: 400 MiB (PyTorch) vs 200 MiB reserved, no driver \
                    call after the first step; a stream's loop of small blocks hits after its first \
                    miss, no backend call (`replay/tests/real_traces.rs`, `devices/tests/loans.rs`)",
    },
    Deviation {
        rule: "releasing the cache before a growth, in a job that empties it",
        pytorch: "releases cached memory only when the device is full (or past \
                   `garbage_collection_threshold`), and when the user calls `empty_cache`",
        gpualloc: "after the user's `empty_cache`, up to 4 growths of an expandable segment that \
                    would pass the most ever held first release the cache as `empty_cache` \
                    does (synchronize pending events, unmap free pages); the growth then maps \
                    them where the request needs them (`devices/src/miss/chain.rs`, \
                    `ReleaseBeforeGrowth`; `devices/src/budget.rs`)",
        why: "free pages strand in holes between live blocks and on other streams; a job that \
               empties its cache between steps pays for releases already, and a job that never \
               does is never touched (a repeated step of it makes no driver call for this rule)",
        evidence: "default config, llama7b-offload-10streams (39 `empty_cache`s): peak reserved \
                    20,852 -> 19,950 MiB (PyTorch 21,476), fragmentation 4.86% -> 0.56%, growths \
                    642 -> 721 (PyTorch's 728); qwen2-7b-layerwise-calib 4,388 -> 4,364 MiB \
                    (5.43% -> 4.91%); the five traces that never empty their cache unchanged \
                    (`replay/tests/real_traces.rs`, `devices/tests/release_before_growth.rs`)",
    },
    Deviation {
        rule: "moving free pages before a growth past the most ever held",
        pytorch: "a growth maps new pages beside the free ones it cannot use",
        gpualloc: "a growth of the default large pool's expandable segment that would pass the \
                    most ever held first unmaps the default pools' free pages (every stream's, \
                    the small pool's whole free pages too), when they come to at least 3/4 of \
                    the request, and then maps only what the request needs, no pages ahead; \
                    once per rise of that mark, with no synchronization (each unmap waits for \
                    its segment's stream, as every unmap does); not for private pools nor small \
                    requests (`devices/src/miss/chain.rs`, `ReleaseBeforeGrowth`; \
                    `devices/src/budget.rs`)",
        why: "free pages strand in holes between live blocks a request cannot use, and the \
               growth beside them sets a new peak; moved where the request needs them, they \
               keep the peak down. Once the mark stops rising, a repeated step moves nothing",
        evidence: "default config, peak reserved: qwen2-7b-layerwise-calib 4,364 -> 4,222 MiB \
                    (PyTorch 5,926), fragmentation 4.91% -> 1.71%; transformer-lm-forward 2.91% \
                    -> 2.40%; qwen3-gcn devices 0 and 2 1.00% -> 0.83%, 1.46% -> 0.70%; \
                    llama7b-offload 0.56% -> 0.50%; growths at most 1.41x PyTorch's (qwen3-gcn \
                    device 2: 110 vs 78); qwen3-gcn device 2 with `max_split_size_mb:128` 190 -> \
                    30 MiB over PyTorch's. A share of 1/2 of the request instead of 3/4 reserves \
                    62 MiB more than PyTorch on transformer-lm-train with \
                    `expandable_segments:True`, 1 reserves 4 MiB more on qwen3-gcn device 0, 3/2 \
                    leaves qwen2 at 7.04% (`replay/tests/real_traces.rs`, \
                    `devices/tests/release_before_growth.rs`)",
    },
    Deviation {
        rule: "small requests in the large pool's free memory (spill)",
        pytorch: "blocks of 1 MiB or less come only from the small pool's 2 MiB pages; a small \
                   request that misses maps or allocates a new one",
        gpualloc: "a small request that misses the default small pool, where a new small page \
                    would pass the most that pool ever held, of a size whose last block lived at \
                    most 1,000 allocations, takes the best-fitting free block of the default \
                    large pool's expandable segment on its stream, split to its size, and goes \
                    back there when freed; a size never freed yet does so too once a small block \
                    has been freed and where a new small page would make the small pool more than \
                    1/16 of the large pool's mapped memory, but only into a free block at the end \
                    of the large pool's mapped pages; known long-lived sizes, private pools, \
                    ordinary segments and captures never spill \
                    (`devices/src/malloc/spill.rs`, `spill_state.rs`)",
        why: "small temporaries that peak while the large blocks are low otherwise hold an extra \
               small page all run beside the large pool's peak, and a first step's temporaries, \
               not freed yet, set the small pool's mark for every later step; long-lived small \
               blocks would pin the large pool's holes, so sizes not known short-lived go only \
               to its mapped end, and not while a job loads what it keeps (nothing small freed \
               yet) or where its small pool is a negligible share",
        evidence: "default config, peak reserved (fragmentation): known short-lived sizes: \
                    cnn-counterfactual-small 108 -> 106 MiB (4.39% -> 2.59%), llama-lora-finetune \
                    5,640 -> 5,630 MiB (0.64% -> 0.46%; growths 258 -> 214), \
                    transformer-lm-forward 756 MiB (growths 44 -> 43), the others unchanged; with \
                    `roundup_power2_divisions:4` llama-lora 5,994 -> 5,992 MiB, \
                    transformer-lm-forward 846 -> 844 MiB; a generated MiniLM-like inference 84 \
                    -> 82 MiB (5.86% -> 3.57%, `replay/tests/small_model.rs`). Then sizes never \
                    freed: cnn-counterfactual-small 106 -> 104 MiB (2.59% -> 0.71%; growths 17 -> \
                    16, driver maps 38 -> 36), llama-lora 5,630 -> 5,634 MiB (0.46% -> 0.53%), \
                    with `roundup_power2_divisions:4` 5,992 -> 5,998 MiB, the MiniLM-like \
                    inference 82 -> 80 MiB (3.57% -> 1.16%), the others unchanged. Spilling \
                    within the small pool's mark too: llama7b-offload 0.16% -> 0.26%, qwen2 1.25% \
                    -> 1.39%, and a repeated step of mixed sizes mapped pages until its third \
                    step; sizes never freed without the share: qwen3-gcn device 2 20,618 -> \
                    20,694 MiB (`replay/tests/real_traces.rs`, `devices/tests/spill.rs`)",
    },
    Deviation {
        rule: "segments under a config that does not name `expandable_segments`",
        pytorch: "ordinary segments (`cudaMalloc`); expandable ones only when asked",
        gpualloc: "expandable segments where every device of the backend has virtual memory (asked \
                    without a context: CUDA's `VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` attribute), with \
                    the rules above; `expandable_segments:False` keeps ordinary ones \
                    (`AllocatorConfig::resolved`)",
        why: "an expandable segment grows where an ordinary one would allocate another segment, so \
               the large pool's free memory is one block per stream instead of a remainder in each \
               segment (PyTorch's own advice against fragmentation)",
        evidence: "default config, peak reserved: llama-lora-finetune 6,192 MiB (PyTorch) vs 5,642 \
                    MiB, transformer-lm-forward-bf16 822 vs 766 MiB, transformer-lm-train 13,436 vs \
                    13,296 MiB, a generated MiniLM-like inference 102 vs 84 MiB; driver calls during \
                    warm-up: 230 / 43 / 240 / 12 segment mallocs vs 329 / 45 / 673 / 16 page maps, \
                    none after (`replay/tests/real_traces.rs`, `small_model.rs`)",
    },
    Deviation {
        rule: "the allocator's driver calls during a stream capture (both policies)",
        pytorch: "puts the thread in relaxed capture mode around `cudaMalloc` only; its other \
                   calls (`cudaFree`, event queries and synchronizations, the expandable \
                   segments' maps) keep the thread's mode",
        gpualloc: "every potentially unsafe call of the allocators (malloc, free, reserve, map, \
                    unmap, event and stream queries and synchronizations, pinned memory) runs \
                    in relaxed mode, the thread's mode restored after it \
                    (`gpualloc_runtime::CaptureSafe`)",
        why: "the allocator calls the driver from its own threads (misses off the gate, the \
               reaper) and from every task that allocates: under a global-mode capture any such \
               call from any thread invalidates the capture",
        evidence: "four tasks missing on another stream during a global capture leave it valid \
                    (`tests/graphs.rs`); the emulated driver and the sim invalidate a capture on \
                    such a call made in global mode (`capture_modes_across_threads`)",
    },
    Deviation {
        rule: "a free used on a stream that captures without the allocator being told",
        pytorch: "records its events on that stream (they become the graph's, and the next event \
                   query fails)",
        gpualloc: "the free waits until that stream stops capturing, as frees wait during the \
                    allocator's own captures; no event is ever recorded on a capturing stream",
        why: "an event recorded in a capture cannot be queried (`CUDA_ERROR_CAPTURED_EVENT`) and \
               would not mean the work is done",
        evidence: "`devices/tests/capture.rs`: zero event records during the capture, one after \
                    it, the block back once the stream's work ran",
    },
    Deviation {
        rule: "a use recorded during a capture on a stream outside it",
        pytorch: "every use recorded while any capture is under way is taken for the graph's: \
                   a free held back for the capture records no event for it, and the block may \
                   be reused while that stream's work still runs",
        gpualloc: "only a use on a stream that is part of a capture (begun, joined, or reported \
                    capturing by the backend) is the graph's; a use on any other stream gets its \
                    event when the held-back free is made",
        why: "async tasks allocate and record uses on their own streams while another task \
               captures; their work is eager, not the graph's",
        evidence: "`devices/tests/capture.rs`: a block used on a stream outside the capture waits \
                    for it (2 event records at the capture's end, 1 before); the stress test's \
                    graph runs (`tests/stress.rs`) saw a buffer overwritten while in use before",
    },
    Deviation {
        rule: "the stream of a capture before and during it",
        pytorch: "`torch.cuda.graph` synchronizes the device before the capture; an expandable \
                   segment's unmap synchronizes its stream whatever that stream does",
        gpualloc: "the capture begins once its stream's queued work has run (awaited, not the \
                    device), and from just before it begins (`prepare_capture`) until it ends, \
                    no free page of the stream's expandable segments is unmapped, and no \
                    release already detached is still in flight; a pool's sleep that would wait \
                    for a capturing stream is refused (`AllocError::CaptureUnderway`)",
        why: "a block freed on the stream may serve the capture while the stream's work still \
               reads it, and the graph may be launched on another stream; synchronizing a \
               capturing stream invalidates its capture",
        evidence: "`tests/graph_launches.rs`: a block freed on the stream with a 300 ms read \
                    queued, reused by the capture and launched on another stream, was overwritten \
                    before the read (1 failed kernel) without the wait; `devices/tests/capture.rs`; \
                    the stress test with captures: 1 invalidated capture in 11 runs of one config \
                    before, 0 in 40 after",
    },
    Deviation {
        rule: "the capture pool's memory on other streams",
        pytorch: "`torch.cuda.graph` synchronizes the device before the capture; a free on any \
                   stream goes back to its pool at once, a capture's included",
        gpualloc: "after the capture is announced, it waits for the queued work of every other \
                    stream that has segments in the capture's pool; a free of a block of that \
                    pool on a stream outside the capture is held back until the capture ends, \
                    and so is the free, on a stream that joined the capture, of one handed out \
                    to that stream before it joined; a stream that prepares a capture neither \
                    lends nor borrows, and a use on it holds a free back",
        why: "a stream that joins the capture gets its own free blocks of the pool there, and \
               the graph runs wherever it is launched, unordered with that stream's work from \
               before the join; a named pool serves eager requests too; the core's check of a \
               stream's capture status and its event record could straddle the begin",
        evidence: "`tests/graph_launches.rs`: a block freed on a stream with a 300 ms read queued, \
                    reused once that stream joined the capture, was overwritten by a launch \
                    before the read without the wait, and a block freed there during the \
                    capture was handed to it without the hold, as was one allocated there before \
                    or during the capture, read there after its begin and freed after the stream \
                    joined it; `devices/tests/loans.rs`, \
                    `devices/tests/capture.rs`; the stress test on the emulated driver: 1 failed \
                    run in 2 (60 seeds each, `expandable_segments:False`) before, 0 in 6 after",
    },
    Deviation {
        rule: "what the end of the last capture does",
        pytorch: "the frees a capture held back are made at the next `process_events` with no \
                   capture under way (`torch.cuda.graph` begins each capture with an \
                   `empty_cache`, which makes them); `empty_cache` during a capture fails an \
                   internal assertion",
        gpualloc: "they are made when the last capture ends; `empty_cache` during a capture is \
                    a typed error (`AllocError::CaptureUnderway`)",
        why: "graphs captured back to back into one pool (a serving engine's batch sizes) must \
               find the memory the previous capture freed without an `empty_cache` that would \
               also empty every other pool",
        evidence: "a second graph captured into the same pool gets the first one's pointers and \
                    no new memory (`tests/graphs.rs`)",
    },
    Deviation {
        rule: "a graph pool's memory when its last holder goes",
        pytorch: "the pool is released when its last graph is reset; its free segments go back \
                   at the next `empty_cache` or out-of-memory release",
        gpualloc: "released when the last `GraphPool` handle, capture or `Graph` is dropped, and \
                    its free segments freed at once (buffers still alive keep theirs until \
                    dropped and the cache is emptied)",
        why: "a dropped graph's memory is wanted back by the next graph or request, and nothing \
               else may reuse it",
        evidence: "pool, graph and buffers dropped in three orders leave nothing reserved after \
                    an `empty_cache` (`tests/graphs.rs`)",
    },
    Deviation {
        rule: "a graph's launches",
        pytorch: "a replay records nothing; once the graph is reset its pool is released, and \
                   its memory freed at the next release: `cudaFree` waits for the device, an \
                   expandable segment's unmap for the segment's stream alone",
        gpualloc: "each launch records an event on its stream; a dropped graph keeps its pool \
                    until those events are complete, and meanwhile (as while it lives) the pool's \
                    memory is not orphaned with a dropped stream, released at the pool's quota or \
                    lent on out-of-memory, and a sleep waits; a launch into a capture is refused",
        why: "the allocator sees no launch, and a graph launched on another stream than the \
               capture's still writes the pool's memory while a release that waits for the \
               segment's stream unmaps it",
        evidence: "a graph of expandable segments launched on another stream, then graph and pool \
                    dropped and `empty_cache`: 1 failed kernel (an unmapped write) before, 0 \
                    after; one event record per launch (`tests/graph_launches.rs`)",
    },
];

/// [`DEVIATIONS`] as the README's Markdown table: a header and one row per departure.
pub fn deviations_table() -> String {
    let mut table =
        String::from("| rule | PyTorch | gpualloc | why | effect |\n|---|---|---|---|---|\n");
    for d in DEVIATIONS {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            d.rule, d.pytorch, d.gpualloc, d.why, d.evidence
        ));
    }
    table
}
