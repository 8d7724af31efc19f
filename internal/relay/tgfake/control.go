package tgfake

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// Control serves the test's side over HTTP, for a server that runs inside
// a test machine (checks/system/tgfake): POST /message (a Message; answers
// the update_id), POST /file?name=N (the body; answers a Document), POST
// /fault (a Fault), GET /sent?from=N&wait=D&method=M (blocks up to D for a
// call of method M from seq N on), GET /pending.
func (s *Server) Control() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /message", func(w http.ResponseWriter, r *http.Request) {
		var m Message
		if err := json.NewDecoder(r.Body).Decode(&m); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		json.NewEncoder(w).Encode(s.AddMessage(m))
	})
	mux.HandleFunc("POST /file", func(w http.ResponseWriter, r *http.Request) {
		data, err := readAll(r)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		json.NewEncoder(w).Encode(s.AddFile(r.URL.Query().Get("name"), data))
	})
	mux.HandleFunc("POST /fault", func(w http.ResponseWriter, r *http.Request) {
		var f Fault
		if err := json.NewDecoder(r.Body).Decode(&f); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		s.Inject(f)
	})
	mux.HandleFunc("GET /sent", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		from, _ := strconv.Atoi(q.Get("from"))
		if d, err := time.ParseDuration(q.Get("wait")); err == nil {
			ctx, cancel := context.WithTimeout(r.Context(), d)
			method := q.Get("method")
			s.WaitSent(ctx, from, func(x Sent) bool { return method == "" || x.Method == method })
			cancel()
		}
		json.NewEncoder(w).Encode(s.Sent(from))
	})
	mux.HandleFunc("GET /pending", func(w http.ResponseWriter, r *http.Request) {
		json.NewEncoder(w).Encode(s.Pending())
	})
	return mux
}

func readAll(r *http.Request) ([]byte, error) { return io.ReadAll(r.Body) }

// Remote drives a Server's Control API over a unix socket (a test on the
// host, the server in a machine).
type Remote struct {
	c *http.Client
}

// NewRemote talks to the control socket at path.
func NewRemote(path string) *Remote {
	return &Remote{c: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		},
	}}}
}

func (r *Remote) do(ctx context.Context, method, path string, body io.Reader, out any) error {
	req, err := http.NewRequestWithContext(ctx, method, "http://tgfake"+path, body)
	if err != nil {
		return err
	}
	resp, err := r.c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("tgfake %s %s: %s %s", method, path, resp.Status, b)
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// AddMessage queues a message update.
func (r *Remote) AddMessage(ctx context.Context, m Message) error {
	b, _ := json.Marshal(m)
	return r.do(ctx, http.MethodPost, "/message", bytes.NewReader(b), nil)
}

// AddFile stores an uploaded file and returns its Document.
func (r *Remote) AddFile(ctx context.Context, name string, data []byte) (*Document, error) {
	var d Document
	err := r.do(ctx, http.MethodPost, "/file?name="+url.QueryEscape(name), bytes.NewReader(data), &d)
	return &d, err
}

// Inject makes calls fail (Server.Inject).
func (r *Remote) Inject(ctx context.Context, f Fault) error {
	b, _ := json.Marshal(f)
	return r.do(ctx, http.MethodPost, "/fault", bytes.NewReader(b), nil)
}

// Sent returns what was sent from seq on.
func (r *Remote) Sent(ctx context.Context, from int) ([]Sent, error) {
	var out []Sent
	err := r.do(ctx, http.MethodGet, fmt.Sprintf("/sent?from=%d", from), nil, &out)
	return out, err
}

// WaitSent waits until a call from seq on satisfies ok.
func (r *Remote) WaitSent(ctx context.Context, from int, ok func(Sent) bool) (Sent, error) {
	for {
		var out []Sent
		if err := r.do(ctx, http.MethodGet, fmt.Sprintf("/sent?from=%d&wait=2s", from), nil, &out); err != nil {
			return Sent{}, err
		}
		for _, s := range out {
			if ok(s) {
				return s, nil
			}
		}
		if len(out) > 0 {
			from = out[len(out)-1].Seq + 1
		}
		select {
		case <-ctx.Done():
			return Sent{}, fmt.Errorf("nothing matching was sent: %w", ctx.Err())
		default:
		}
	}
}
