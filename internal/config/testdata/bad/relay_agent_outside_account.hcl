# want: 17:14 Agent outside the relay's account
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
  chat "bob" {
    chat_id = -100123
  }
}
