from trtspec.cli import main

main()
