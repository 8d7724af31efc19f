// Package tg is the relay's Telegram side: a client over the Bot API
// library (github.com/go-telegram/bot, docs/relay.md says why that one)
// that long-polls for updates and sends within Telegram's limits, honouring
// a 429's retry_after; and the splitting of long answers.
//
// Only this package talks to Telegram, and it knows nothing of caged: the
// relay package joins the two.
package tg

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/go-telegram/bot"
	"github.com/go-telegram/bot/models"
)

// Target is where a message goes: a chat and, in a forum group, a topic
// (message_thread_id; 0 for none).
type Target struct {
	ChatID int64
	Topic  int
}

// Options configure a Client.
type Options struct {
	APIURL string // Bot API server base address
	// PollTimeout is how long one getUpdates waits for news (default 50s).
	PollTimeout time.Duration
	Limiter     *Limiter // default NewLimiter(nil)
	Log         *slog.Logger
	// MaxRetries of a send answered 429 (default 5).
	MaxRetries int
}

// Client is a connection to the Bot API.
type Client struct {
	b          *bot.Bot
	token      string
	http       *http.Client
	lim        *Limiter
	log        *slog.Logger
	maxRetries int
	updates    chan *models.Update
	// Username is the bot's @name (without @), from getMe.
	Username string
	ID       int64
}

// ErrTooLarge: a file is above the size limit; nothing was kept.
var ErrTooLarge = errors.New("file too large")

// New checks the token with getMe and prepares long polling (Run).
func New(ctx context.Context, token string, o Options) (*Client, error) {
	if o.PollTimeout == 0 {
		o.PollTimeout = 50 * time.Second
	}
	if o.Limiter == nil {
		o.Limiter = NewLimiter(nil)
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.MaxRetries == 0 {
		o.MaxRetries = 5
	}
	c := &Client{token: token, lim: o.Limiter, log: o.Log, maxRetries: o.MaxRetries, updates: make(chan *models.Update, 64)}
	// The client's own timeout bounds a hung connection; a long poll
	// answers within PollTimeout, an upload of a large file takes longer.
	c.http = &http.Client{Timeout: o.PollTimeout + 3*time.Minute}
	b, err := bot.New(token,
		bot.WithServerURL(strings.TrimSuffix(o.APIURL, "/")),
		bot.WithHTTPClient(o.PollTimeout, c.http),
		bot.WithSkipGetMe(), // below, with the caller's context
		// Messages only: edits, reactions and the rest are not commands.
		bot.WithAllowedUpdates(bot.AllowedUpdates{"message"}),
		// One update at a time into Updates(): the relay decides what runs
		// concurrently, and a full channel holds the poller back.
		bot.WithNotAsyncHandlers(),
		bot.WithDefaultHandler(func(ctx context.Context, _ *bot.Bot, u *models.Update) {
			select {
			case c.updates <- u:
			case <-ctx.Done():
			}
		}),
		bot.WithErrorsHandler(func(err error) {
			c.log.Warn("telegram", "err", c.redact(err))
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("telegram: %v", c.redact(err))
	}
	c.b = b
	me, err := b.GetMe(ctx)
	if err != nil {
		return nil, fmt.Errorf("telegram getMe (is the token right?): %v", c.redact(err))
	}
	c.Username, c.ID = me.Username, me.ID
	return c, nil
}

// Run long-polls until ctx ends; updates arrive on Updates.
func (c *Client) Run(ctx context.Context) {
	c.b.Start(ctx)
}

// Updates delivers each message update once, in order.
func (c *Client) Updates() <-chan *models.Update { return c.updates }

// redact keeps the token out of every error the relay logs or shows: it
// is part of each request's URL.
func (c *Client) redact(err error) string {
	if err == nil {
		return ""
	}
	if c.token == "" {
		return err.Error()
	}
	return strings.ReplaceAll(err.Error(), c.token, "<token>")
}

// send runs one Bot API call in a booked slot of chat, again after a 429
// once its retry_after has passed (up to MaxRetries times).
func (c *Client) send(ctx context.Context, chat int64, method string, call func(context.Context) error) error {
	for attempt := 0; ; attempt++ {
		if err := sleep(ctx, c.lim.Reserve(chat)); err != nil {
			return err
		}
		err := call(ctx)
		var tm *bot.TooManyRequestsError
		if errors.As(err, &tm) && attempt < c.maxRetries {
			d := time.Duration(tm.RetryAfter) * time.Second
			if d <= 0 {
				d = time.Second
			}
			c.log.Warn("telegram rate limit: waiting as told", "method", method, "chat", chat, "retry_after", d.String(), "attempt", attempt+1)
			c.lim.Block(chat, d)
			continue
		}
		if err != nil {
			return fmt.Errorf("telegram %s: %s", method, c.redact(err))
		}
		return nil
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// SendText sends one message (at most MaxMessage; Split first), as plain
// text: an agent's answer is never parsed as markup.
func (c *Client) SendText(ctx context.Context, t Target, text string) error {
	return c.send(ctx, t.ChatID, "sendMessage", func(ctx context.Context) error {
		_, err := c.b.SendMessage(ctx, &bot.SendMessageParams{
			ChatID: t.ChatID, MessageThreadID: t.Topic, Text: text,
			LinkPreviewOptions: &models.LinkPreviewOptions{IsDisabled: bot.True()},
		})
		return err
	})
}

// SendDocument uploads a file; open is called for each attempt.
func (c *Client) SendDocument(ctx context.Context, t Target, name, caption string, open func() (io.ReadCloser, error)) error {
	return c.send(ctx, t.ChatID, "sendDocument", func(ctx context.Context) error {
		r, err := open()
		if err != nil {
			return err
		}
		defer r.Close()
		_, err = c.b.SendDocument(ctx, &bot.SendDocumentParams{
			ChatID: t.ChatID, MessageThreadID: t.Topic, Caption: caption,
			Document: &models.InputFileUpload{Filename: name, Data: &reader{r}},
		})
		return err
	})
}

// reader is an io.Reader behind a pointer: the library calls
// reflect.Value.IsNil on InputFileUpload.Data, which panics for a reader
// that is a struct value (io.NopCloser's, for one).
type reader struct{ io.Reader }

// Typing shows "typing…" in the chat for about 5 s, if a send slot is free
// now; a typing indicator is never worth delaying an answer for.
func (c *Client) Typing(ctx context.Context, t Target) error {
	if !c.lim.TryReserve(t.ChatID) {
		return nil
	}
	_, err := c.b.SendChatAction(ctx, &bot.SendChatActionParams{ChatID: t.ChatID, MessageThreadID: t.Topic, Action: models.ChatActionTyping})
	if err != nil {
		return fmt.Errorf("telegram sendChatAction: %s", c.redact(err))
	}
	return nil
}

// Download writes the file fileID to w, refusing one above max bytes
// (by its announced size, and again while copying).
func (c *Client) Download(ctx context.Context, fileID string, max int64, w io.Writer) (int64, error) {
	f, err := c.b.GetFile(ctx, &bot.GetFileParams{FileID: fileID})
	if err != nil {
		return 0, fmt.Errorf("telegram getFile: %s", c.redact(err))
	}
	if f.FileSize > max {
		return 0, fmt.Errorf("%w: %d bytes, the limit is %d", ErrTooLarge, f.FileSize, max)
	}
	if f.FilePath == "" {
		return 0, fmt.Errorf("telegram getFile: no file_path in the answer")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.b.FileDownloadLink(f), nil)
	if err != nil {
		return 0, fmt.Errorf("telegram file download: %s", c.redact(err))
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, fmt.Errorf("telegram file download: %s", c.redact(err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("telegram file download: %s", resp.Status)
	}
	n, err := io.Copy(w, io.LimitReader(resp.Body, max+1))
	if err != nil {
		return n, fmt.Errorf("telegram file download: %s", c.redact(err))
	}
	if n > max {
		return n, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, max)
	}
	return n, nil
}
