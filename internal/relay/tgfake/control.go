package tgfake

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
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
