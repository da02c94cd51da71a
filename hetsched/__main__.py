from hetsched.cli import main

main()
