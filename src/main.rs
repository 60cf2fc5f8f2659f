#![forbid(unsafe_code)]

fn main() {
    println!("delayd");
}
