# want: 17:16 Invalid Bot API address
agent "alice" {
  command = ["/bin/true"]
}
agent "bob" {
  command = ["/bin/true"]
}
account "relay" {
  user   = "cage-relay"
  role   = "operator"
  agents = ["alice"]
}
relay {
  token_file = "/etc/nixcage/secrets/telegram"
  owners     = [42]
  account    = "relay"
  api_url    = "http://api.telegram.org"
  chat "alice" {
    chat_id = -100123
  }
}
