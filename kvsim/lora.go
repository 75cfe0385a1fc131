package kvsim

import (
	"net/http"
	"sort"
	"time"
)

type gpuResidency uint8

const (
	gpuNone gpuResidency = iota
	gpuLoading
	gpuReady
)

// adapterState is where one LoRA adapter lives: storage always, host memory (an LRU of
// max_cpu_loras), and one of max_loras GPU slots. A request for an adapter waits until the
// adapter is in a GPU slot; loading it does not stall the other sequences.
type adapterState struct {
	name       string
	path       string
	onHost     bool
	gpu        gpuResidency
	loadDoneAt time.Duration
	lastUsed   time.Duration
	running    int
	waiting    int
	removed    bool
}

// AdapterInfo describes a known adapter, for /v1/models.
type AdapterInfo struct {
	Name string
	Path string
}

// RegisterAdapter makes an adapter known (on storage). It returns false if the name is
// already registered.
func (e *Engine) RegisterAdapter(name, path string) bool {
	if a, ok := e.adapters[name]; ok {
		if !a.removed {
			return false
		}
		a.removed, a.path = false, path
		return true
	}
	e.adapters[name] = &adapterState{name: name, path: path}
	return true
}

// LoadAdapterToHost registers an adapter if needed and puts it in host memory, as vLLM's
// /v1/load_lora_adapter does. An adapter already loaded is a 400 APIError unless inplace
// (vLLM's load_inplace), which swaps in the weights at path where the old ones were: in host
// memory, and in its GPU slot if it has one (vLLM reloads and reactivates it at once). As a
// first load, a load through the API costs no simulated time.
func (e *Engine) LoadAdapterToHost(name, path string, inplace bool) error {
	if a, ok := e.adapters[name]; ok && !a.removed {
		if !inplace {
			return errAdapterLoaded(name)
		}
		a.path = path
		e.putOnHost(a)
		return nil
	}
	e.RegisterAdapter(name, path)
	e.putOnHost(e.adapters[name])
	return nil
}

// UnregisterAdapter forgets an adapter: new requests for it fail with 404. Requests already
// queued or running finish normally.
func (e *Engine) UnregisterAdapter(name string) error {
	a, ok := e.adapters[name]
	if !ok || a.removed {
		return newAPIError(http.StatusNotFound, "The lora adapter '"+name+"' cannot be found.")
	}
	a.removed = true
	if a.running == 0 && a.waiting == 0 && a.gpu != gpuLoading {
		if a.gpu == gpuReady {
			e.gpuCount--
		}
		delete(e.adapters, name)
	}
	return nil
}

// HasAdapter reports whether name is a known adapter.
func (e *Engine) HasAdapter(name string) bool {
	a, ok := e.adapters[name]
	return ok && !a.removed
}

// Adapters lists the known adapters sorted by name.
func (e *Engine) Adapters() []AdapterInfo {
	var out []AdapterInfo
	for _, a := range e.adapters {
		if !a.removed {
			out = append(out, AdapterInfo{Name: a.name, Path: a.path})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// adapterReady reports whether a's GPU slot is ready, starting its load when a slot is free
// or can be freed by evicting the least recently used idle adapter.
func (e *Engine) adapterReady(a *adapterState) bool {
	switch a.gpu {
	case gpuReady:
		return true
	case gpuLoading:
		return false
	}
	if e.gpuCount >= e.cfg.MaxLoRAs {
		var victim *adapterState
		for _, c := range e.adapters {
			// Ties by name: the map's order would make runs differ.
			if c.gpu == gpuReady && c.running == 0 && c.waiting == 0 &&
				(victim == nil || c.lastUsed < victim.lastUsed || (c.lastUsed == victim.lastUsed && c.name < victim.name)) {
				victim = c
			}
		}
		if victim == nil {
			return false
		}
		victim.gpu = gpuNone
		e.gpuCount--
	}
	latency := e.cfg.LoRAStorageLoad
	if a.onHost {
		latency = e.cfg.LoRAHostLoad
		e.hostLoads++
	} else {
		e.storageLoads++
	}
	a.gpu = gpuLoading
	a.loadDoneAt = e.now + latency
	e.gpuCount++
	return false
}

// completeLoads marks adapters whose load finished by now as ready (and on host).
func (e *Engine) completeLoads() {
	for _, a := range e.adapters {
		if a.gpu == gpuLoading && a.loadDoneAt <= e.now {
			a.gpu = gpuReady
			a.lastUsed = e.now
			e.putOnHost(a)
		}
	}
}

// putOnHost adds a to the host cache, evicting the least recently used adapter that is not
// on the GPU when the cache is full.
func (e *Engine) putOnHost(a *adapterState) {
	if a.onHost {
		return
	}
	a.onHost = true
	hosted := 0
	for _, c := range e.adapters {
		if c.onHost {
			hosted++
		}
	}
	for hosted > e.cfg.MaxCPULoRAs {
		var victim *adapterState
		for _, c := range e.adapters {
			if c.onHost && c != a && c.gpu == gpuNone &&
				(victim == nil || c.lastUsed < victim.lastUsed || (c.lastUsed == victim.lastUsed && c.name < victim.name)) {
				victim = c
			}
		}
		if victim == nil {
			return
		}
		victim.onHost = false
		hosted--
	}
}
